"""The interpreter patch must be active; without it every bf16 kernel test below would prove nothing."""
import os

import pytest
import torch
import triton
import triton.language as tl

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter patch is only used without a GPU", allow_module_level=True)

import kernels  # noqa: E402  (its _top2: the custom combine under test)
from nanolp import interp_patch  # noqa: E402


def test_self_test_fails_without_patch():
    """The self-test must be able to fail: with the stock interpreter restored it has to raise."""
    B, R = interp_patch._Builder, interp_patch._Reduce
    patched = {name: getattr(B if hasattr(B, name) else R, name) for name in interp_patch._orig}
    try:
        for name, fn in interp_patch._orig.items():
            setattr(B if name not in ("sum", "min_max") else R, name, fn)
        with pytest.raises(AssertionError):
            interp_patch.self_test()
    finally:
        for name, fn in patched.items():
            setattr(B if name not in ("sum", "min_max") else R, name, fn)
    interp_patch.self_test()


def test_an_unchecked_triton_is_refused(monkeypatch):
    """The patch reaches into the interpreter's internals: on a Triton it was not checked on, apply() refuses
    loudly instead of patching what may have moved."""
    monkeypatch.setattr(triton, "__version__", "3.5.1")
    with pytest.raises(RuntimeError, match="checked on triton"):
        interp_patch.apply()


@triton.jit
def _top2_kernel(S, R, R2, COLS: tl.constexpr):
    rows = tl.arange(0, 32)
    s = tl.load(S + rows[:, None] * COLS + tl.arange(0, COLS)[None, :])
    r, r2 = tl.reduce((s, tl.full(s.shape, float("-inf"), tl.float32)), 1, kernels._top2)
    tl.store(R + rows, r)
    tl.store(R2 + rows, r2)


def test_vectorized_generic_reduce_equals_the_stock_one(monkeypatch):
    """The patch's tl.reduce with a custom combine (a slice at a time) gives the stock interpreter's results (an
    element at a time), here for kernels.py's top-2 on rows with ties and -inf; and the top-2 is right."""
    g = torch.Generator().manual_seed(0)
    s = torch.randint(-4, 4, (32, 64), generator=g).float()
    s[:4] = -float("inf")
    s[4, :3] = float("inf")
    results = []
    for generic_reduce in (interp_patch._generic_reduce, interp_patch._stock_generic_reduce):
        monkeypatch.setattr(interp_patch._Reduce, "generic_reduce", generic_reduce)
        r, r2 = torch.empty(32), torch.empty(32)
        _top2_kernel[(1,)](s, r, r2, COLS=64)
        results.append((r, r2))
    (r, r2), (r_stock, r2_stock) = results
    assert torch.equal(r, r_stock) and torch.equal(r2, r2_stock)
    top = s.sort(-1, descending=True).values
    assert torch.equal(r, top[:, 0]) and torch.equal(r2, top[:, 1])


@triton.jit
def _tma_add_kernel(DESC, X, ROWS: tl.constexpr, COLS: tl.constexpr):
    x = tl.load(X + tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :])
    DESC.atomic_add([1, tl.program_id(0) * (ROWS // 2), 0], tl.reshape(x, [1, ROWS, COLS]))


def test_tma_reduction_adds_in_launch_order_and_drops_rows_past_the_end():
    """A tensor descriptor's atomic_add (experiments/launch_variants.py's one-pass dQ with DQ_TMA), which the stock
    interpreter lacks: each program's block added in fp32 where it lies in the tensor, as tl.atomic_add adds,
    programs in launch order, rows past the tensor's end dropped (not written to the next slice)."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    buf = torch.zeros(3, 20, 32)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    _tma_add_kernel[(3,)](TensorDescriptor(buf, list(buf.shape), list(buf.stride()), [1, 16, 32]), x,
                          ROWS=16, COLS=32)
    want = torch.zeros(3, 20, 32)
    for start in (0, 8, 16):
        rows = want[1, start:start + 16]
        rows += x[:len(rows)]                                     # in launch order, in fp32
    assert torch.equal(buf, want)
