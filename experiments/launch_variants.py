"""kernels.py's launches in settings other than its own, for the experiments that time and compile them
(tuning.py, forward_split.py, backward_variants.py, sass.py, bench.py): other tiles, warps and stages (tuned),
and the one-pass backward (one_pass_attention).

The one-pass backward sums dQ in the dK/dV pass: each key tile's program adds dQ_i += dS_ij K_j into an fp32
buffer in O's layout, by fp32 atomics or by TMA reductions (DQ_TMA), and _bwd_dq_cast_kernel scales and casts
it; 5 matrix products per tile pair instead of kernels.py's 7, at most 8-10% faster, but dQ's last bits follow
the GPU's order of programs (docs/kernel.md, "Which backward is the default"). Its delta is kernels.py's
(kernels.bwd_delta, the two-pass tiles), so both backwards read the same delta.
"""
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import kernels
from kernels import Numerics, _bwd_dkdv_tile, amplified_v

# Tuning, as kernels.BWD_TUNING's (results/speed/README.md, "kernels.py's settings and the timings behind them").
ONE_PASS_TUNING = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 3), 128: (64, 128, 8, 2)}
# dQ's shares: False, fp32 atomics; True, TMA reductions; None, TMA on sm_90 and later (docs/kernel.md, "Speed").
DQ_TMA = None


class _WithOptions:
    """A kernel whose launches also take these compile options (tuned's maxnreg)."""

    def __init__(self, kernel, **options):
        self.kernel, self.options = kernel, options

    def __getitem__(self, grid):
        return lambda *args, **meta: self.kernel[grid](*args, **meta, **self.options)


@contextmanager
def tuned(fwd=None, bwd=None, block_n=None, maxnreg=None):
    """kernels.py's launches inside the block take these settings (None: its own). fwd, bwd: {head_dim: setting}
    in place of kernels.FWD_TUNING's, BWD_TUNING's at those head_dims; block_n: the forward's key tile (anything
    but kernels.TILE_N changes the numerics: the shift looks for ties within one tile, and nanolp/emulate.py
    follows TILE_N); maxnreg: Triton's cap on the forward's registers per thread (a compile option)."""
    saved = {name: getattr(kernels, name) for name in ("FWD_TUNING", "BWD_TUNING", "TILE_N", "_fwd_kernel")}
    if fwd is not None:
        kernels.FWD_TUNING = {**kernels.FWD_TUNING, **fwd}
    if bwd is not None:
        kernels.BWD_TUNING = {**kernels.BWD_TUNING, **bwd}
    if block_n is not None:
        kernels.TILE_N = block_n
    if maxnreg is not None:
        kernels._fwd_kernel = _WithOptions(kernels._fwd_kernel, maxnreg=maxnreg)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(kernels, name, value)


# ---------------------------------------------------------------------------------------------------------
# The one-pass backward

@triton.jit
def _bwd_dkdv_dq_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N,
                        qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr, DQ_TMA: tl.constexpr):
    # kernels._bwd_dkdv_kernel's program, which also adds dQ_i += dS_ij K_j into DQ, an fp32 buffer in O's
    # layout (DQ_TMA: its descriptor).
    tl.static_assert(BLOCK_N % BLOCK_M == 0)      # so a key tile's diagonal starts on a query tile (below)
    tl.static_assert((DQ.dtype if DQ_TMA else DQ.dtype.element_ty) == tl.float32)   # the shares summed in fp32
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_ob + h * stride_oh           # dO, dK, dV and the dQ buffer are in O's layout
    DK += b * stride_ob + h * stride_oh
    DV += b * stride_ob + h * stride_oh
    if not DQ_TMA:
        DQ += b * stride_ob + h * stride_oh
    LSE += bh * N
    DELTA += bh * N
    start_n = tl.program_id(0) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    start = start_n if CAUSAL else 0              # queries above the diagonal see no key here
    for start_m in range(start, N, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        dk, dv, dsT = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, rows, cols, offs_d, stride_qm, stride_om, N,
                                     qk_scale, CAUSAL, AUTOCAST, FMA)
        if DQ_TMA:
            # The share as one TMA reduction (FA3's way; rows past N dropped by the descriptor's bounds)
            DQ.atomic_add([b.to(tl.int32), h.to(tl.int32), start_m, 0],
                          tl.reshape(tl.dot(tl.trans(dsT), k), [1, 1, BLOCK_M, HEAD_DIM]))
        else:
            # dQ_i += dS_ij K_j into the fp32 buffer (relaxed: nothing reads it before this kernel ends)
            tl.atomic_add(DQ + rows[:, None] * stride_om + offs_d[None, :], tl.dot(tl.trans(dsT), k),
                          mask=rows[:, None] < N, sem="relaxed")
    out = cols[:, None] * stride_om + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols[:, None] < N)     # ROUND: dK
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols[:, None] < N)                  # ROUND: dV


@triton.jit
def _bwd_dq_cast_kernel(DQ_SUM, DQ, stride_ob, stride_oh, stride_om, H, N, sm_scale, HEAD_DIM: tl.constexpr,
                        BLOCK_M: tl.constexpr):
    # dQ = (sum over key tiles of dS K) * scale, cast once; DQ_SUM (fp32) and DQ are both in O's layout.
    bh = tl.program_id(1).to(tl.int64)
    DQ_SUM += (bh // H) * stride_ob + (bh % H) * stride_oh
    DQ += (bh // H) * stride_ob + (bh % H) * stride_oh
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = rows[:, None] * stride_om + tl.arange(0, HEAD_DIM)[None, :]
    dq = tl.load(DQ_SUM + offs, mask=rows[:, None] < N, other=0.0)
    tl.store(DQ + offs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < N)   # ROUND: dQ


def dq_by_tma(device):
    """Whether the one-pass backward adds dQ by TMA reductions here: DQ_TMA, else if sm_90+."""
    if DQ_TMA is not None:
        return DQ_TMA
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def dq_sum_target(dq_sum, block_m, tma):
    """What the one-pass dK/dV kernel adds dQ's shares into: the fp32 buffer (atomics), or with tma a TMA
    descriptor of it in tiles of block_m rows (it needs 16-byte aligned strides but the last: O's, in fp32)."""
    if not tma:
        return dq_sum
    return TensorDescriptor(dq_sum, list(dq_sum.shape), list(dq_sum.stride()), [1, 1, block_m, dq_sum.shape[-1]])


def one_pass_launch(q, k, v, o, causal, precision, fma, tuning=None):
    """kernels.bwd_launch's grids, strides and meta-parameters at the one-pass tiles (tuning, else
    ONE_PASS_TUNING's)."""
    D = q.shape[-1]
    with tuned(bwd={D: tuning or ONE_PASS_TUNING[D]}):
        return kernels.bwd_launch(q, k, v, o, causal, precision, fma)


def one_pass_backward(do, q, k, v, o, lse, causal, precision, from_p, fma, tuning=None, tma=None):
    """kernels.flash_bwd_op's dQ, dK, dV in one pass (tuning: the tiles, warps and stages in place of
    ONE_PASS_TUNING's; tma: in place of dq_by_tma's)."""
    do = kernels.dense_do(do, q, o)
    delta = kernels.bwd_delta(do, q, k, v, o, lse, causal, precision, from_p, fma)
    (per_query, per_key), strides, meta = one_pass_launch(q, k, v, o, causal, precision, fma, tuning)
    tma = dq_by_tma(o.device) if tma is None else tma
    dq, dk, dv = (torch.empty_like(o, dtype=q.dtype) for _ in range(3))   # o is dense: same strides
    dq_sum = torch.zeros_like(o, dtype=torch.float32)                      # the atomics' buffer, O's strides
    sm_scale = q.shape[-1] ** -0.5
    _bwd_dkdv_dq_kernel[per_key](q, k, v, do, lse, delta, dk, dv, dq_sum_target(dq_sum, meta["BLOCK_M"], tma),
                                 *strides, sm_scale, DQ_TMA=tma, **meta)
    _bwd_dq_cast_kernel[per_query](dq_sum, dq, *o.stride()[:3], *q.shape[1:3], sm_scale,
                                   HEAD_DIM=meta["HEAD_DIM"], BLOCK_M=meta["BLOCK_M"], **kernels.UNFUSED)
    return dq, dk, dv


class _OnePassAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, fix, numerics):
        o, lse, o_delta = kernels.forward(q, k, v, causal=causal, fix=fix, numerics=numerics)
        ctx.save_for_backward(q, k, v, o_delta, lse)   # the O that delta will read
        ctx.args = (causal, numerics.precision, numerics.delta == "p", numerics.fma)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*one_pass_backward(do, q, k, v, o, lse, *ctx.args), None, None, None)


def one_pass_attention(q, k, v, causal=True, fix="on", numerics=None):
    """kernels.flash_attention with the one-pass backward."""
    numerics = Numerics() if numerics is None else numerics
    return _OnePassAttention.apply(q, k, amplified_v(v, numerics.o_bits), causal, fix, numerics)
