"""Is an attention backend's gradient error biased? Compare backends on the same inputs against float64.

    python -m experiments.gradbias                      # a GPU: our kernel (fix off / paper / on), torch's flash SDPA
    python -m experiments.gradbias --draws 2 --batch 2  # a CPU: the kernel's emulation only (slow)

Why: the failure needs a gradient error that keeps one sign. The algorithms are the same on paper, so this
measures their gradient errors on inputs like layer 0's: keys and queries drawn from a small vocabulary (a
char model's first layer sees the same vector for every copy of a character, so near-tied scores are common).

Per backend and tensor (O, dQ, dK, dV) it prints:
    rel_rms  RMS of (backend - float64) over RMS of float64: the ordinary size of the error
    z        how one-signed the error is: for each (head, feature), |mean over batch and tokens| divided by
             its standard error, averaged. Unbiased errors give z ~ 0.8; errors that keep one sign grow with
             sqrt(batch * tokens), as a bias accumulating in W_Q / W_K would.
"""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from experiments.tied import reference


def layer0_like(batch, heads, seq, head_dim, vocab, logit_scale, generator, device):
    """q, k, v (bf16) where every token's vectors come from its character (vocab of them) plus a little noise;
    V ~ N(-1, 0.5) per character, dO ~ N(1, 0.5): the sign pattern the mechanism needs."""
    g = generator
    idx = torch.randint(vocab, (batch, seq), generator=g)
    def table(mean=0.0, std=1.0):
        return torch.randn(heads, vocab, head_dim, generator=g) * std + mean
    def per_token(t, noise):
        x = t[:, idx].permute(1, 0, 2, 3)                                   # (batch, heads, seq, head_dim)
        return x + noise * torch.randn(x.shape, generator=g)
    scale = logit_scale ** 0.5 * head_dim ** 0.25                          # q.k / sqrt(d) ~ logit_scale
    q, k = per_token(table(), 0.05) * scale / head_dim ** 0.5, per_token(table(), 0.05) * scale
    v = per_token(table(-1.0, 0.5), 0.05)
    do = torch.randn(v.shape, generator=g) * 0.5 + 1.0
    return [t.to(device=device, dtype=torch.bfloat16).contiguous() for t in (q, k, v, do)]


def float64_grads(q, k, v, do):
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    o = reference(q, k, v, causal=True)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do.double())]


def backend_grads(fn, q, k, v, do):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = fn(q, k, v)
    return [o.detach(), *torch.autograd.grad(o, (q, k, v), do)]


def backends(device):
    if device == "cuda":
        from kernels import flash_attention as ours
    else:
        from nanolp.emulate import emulate_attention as ours
    out = {f"ours, fix {fix}": lambda q, k, v, fix=fix: ours(q, k, v, causal=True, fix=fix)
           for fix in ("off", "paper", "on")}
    if device == "cuda":
        def torch_flash(q, k, v):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out["torch sdpa flash"] = torch_flash
    return out


def stats(err, ref):
    """rel_rms and z (see the module docstring) of err = backend - float64, both (batch, heads, seq, dim)."""
    rel = (err.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    n = err.shape[0] * err.shape[2]
    mean, std = err.mean(dim=(0, 2)), err.std(dim=(0, 2))
    z = (mean.abs() / (std / math.sqrt(n)).clamp_min(1e-30)).mean().item()
    return rel, z


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--logit-scale", type=float, nargs="+", default=[2.0, 8.0, 32.0])
    p.add_argument("--draws", type=int, default=4, help="fresh inputs per logit scale; the table averages them")
    args = p.parse_args(argv)
    if small := [f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "logit_scale" and v < 1]:
        p.error(f"{', '.join(small)}: each is at least 1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    fns = backends(device)
    print(f"{'logit scale':>11}  {'backend':<18}" + "".join(f"{n + ' rel_rms':>13}{n + ' z':>8}"
                                                         for n in ("O", "dQ", "dK", "dV")))
    for scale in args.logit_scale:
        sums = {name: torch.zeros(8) for name in fns}
        for draw in range(args.draws):
            g = torch.Generator().manual_seed(draw)
            q, k, v, do = layer0_like(args.batch, args.heads, args.seq, args.head_dim, args.vocab, scale, g, device)
            ref = float64_grads(q, k, v, do)
            for name, fn in fns.items():
                got = backend_grads(fn, q, k, v, do)
                sums[name] += torch.tensor([x for a, b in zip(got, ref) for x in stats(a.double() - b, b)])
        for name, total in sums.items():
            cells = (total / args.draws).tolist()
            print(f"{scale:>11g}  {name:<18}" + "".join(f"{cells[i]:>13.2e}{cells[i + 1]:>8.1f}"
                                                       for i in range(0, 8, 2)))


if __name__ == "__main__":
    main()
