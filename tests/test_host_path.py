"""experiments/host_path.py's pieces, under the interpreter: the launches it times alone are the four a
forward+backward makes, each one replayable, and its dispatch switch leaves kernels.py as it found it."""
import torch

import kernels
from experiments import host_path


def test_kept_launches_are_the_steps_four_and_replay():
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
                   for s in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    launches = host_path.kept_launches(lambda: kernels.flash_attention(q, k, v).backward(do))
    assert [name for name, *_ in launches] == ["_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel",
                                               "_bwd_dq_kernel"]
    assert all(not isinstance(getattr(kernels, name), host_path.Kept) for name, *_ in launches)
    _, kernel, grid, args, meta = launches[0]
    o = args[3].clone()
    args[3].fill_(float("nan"))
    kernel[grid](*args, **meta)          # the forward again, into the same O: the same bits
    assert torch.equal(args[3], o)


def test_through_the_ops_dispatches_and_restores(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "flash_fwd_op", lambda *a: calls.append("fwd") or kernels.flash_fwd(*a))
    q, k, v = (torch.randn(1, 2, 20, 16, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16)
               for s in range(3))
    direct = kernels.direct
    with host_path.through_the_ops():
        kernels.flash_attention(q, k, v)
    kernels.flash_attention(q, k, v)
    assert calls == ["fwd"] and kernels.direct is direct
