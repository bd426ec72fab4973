"""kernels.py's launches in settings other than its own, for the experiments that time and compile them
(tuning.py, forward_split.py, backward_variants.py, short_backward.py, sass.py, bench.py): other tiles, warps and
stages (tuned), the one-pass backward (one_pass_attention) and the single-pass backward for short sequences
(single_pass_attention).

The one-pass backward sums dQ in the dK/dV pass: each key tile's program adds dQ_i += dS_ij K_j into an fp32
buffer in O's layout, by fp32 atomics or by TMA reductions (DQ_TMA), and _bwd_dq_cast_kernel scales and casts
it; 5 matrix products per tile pair instead of kernels.py's 7, at most 8-10% faster, but dQ's last bits follow
the GPU's order of programs (docs/kernel.md, "Which backward is the default"), unless the shares are added in a
fixed order (ordered=True: the section "dQ in a fixed order"), which gives the two-pass backward's dQ. Its delta
is kernels.py's (kernels.bwd_delta, the two-pass tiles), so both backwards read the same delta.

The single-pass backward is the whole backward of a (batch, head) in one program, one launch for all, for up
to SINGLE_PASS_MAX_SEQ keys, where kernels.py's three launches cost more host time than GPU time; its sums run
in the two-pass backward's order, so under the interpreter it has that backward's bits (its section below).
"""
from contextlib import contextmanager
from functools import partial

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import kernels
from kernels import _bwd_dkdv_tile
from nanolp.numerics import Numerics, amplified_v

# Tuning, as kernels.BWD_TUNING's (docs/kernel.md, "Speed", "kernels.py's settings").
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
def _bwd_dkdv_dq_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, SEM,
                        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                        stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N,
                        qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr, DQ_TMA: tl.constexpr,
                        ORDERED: tl.constexpr, DQ_BLOCK_N: tl.constexpr):
    # kernels._bwd_dkdv_kernel's program, which also adds dQ_i += dS_ij K_j into DQ, an fp32 buffer in O's
    # layout (DQ_TMA: its descriptor). ORDERED: in the dQ kernel's order, each query tile's turn kept by SEM
    # (int32, one per batch, head and query tile; else None) and the share summed over key tiles of DQ_BLOCK_N
    # (the dQ kernel's), as the section "dQ in a fixed order" below says.
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
    if ORDERED:
        SEM += bh * tl.cdiv(N, BLOCK_M)
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
        if ORDERED:
            _add_dq_in_turn(DQ, SEM + start_m // BLOCK_M, dsT, k, rows, offs_d, stride_om, N, DQ_BLOCK_N)
        elif DQ_TMA:
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


def one_pass_backward(do, q, k, v, o, lse, causal, precision, from_p, fma, tuning=None, tma=None, ordered=False):
    """kernels.flash_bwd_op's dQ, dK, dV in one pass (tuning: the tiles, warps and stages in place of
    ONE_PASS_TUNING's; tma: in place of dq_by_tma's; ordered: dQ's shares added in the dQ kernel's order, by
    plain loads and stores, never TMA: the section "dQ in a fixed order")."""
    if ordered and tma:
        raise ValueError("the ordered dQ adds its shares by loads and stores, not by TMA reductions")
    do = kernels.dense_do(do, q, o)
    delta = kernels.bwd_delta(do, q, k, v, o, lse, causal, precision, from_p, fma)
    (per_query, per_key), strides, meta = one_pass_launch(q, k, v, o, causal, precision, fma, tuning)
    tma = not ordered and (dq_by_tma(o.device) if tma is None else tma)
    dq, dk, dv = (torch.empty_like(o, dtype=q.dtype) for _ in range(3))   # o is dense: same strides
    dq_sum = torch.zeros_like(o, dtype=torch.float32)                      # the atomics' buffer, O's strides
    sm_scale = q.shape[-1] ** -0.5
    _bwd_dkdv_dq_kernel[per_key](q, k, v, do, lse, delta, dk, dv, dq_sum_target(dq_sum, meta["BLOCK_M"], tma),
                                 dq_semaphores(o, meta["BLOCK_M"]) if ordered else None, *strides, sm_scale,
                                 DQ_TMA=tma, ORDERED=ordered, DQ_BLOCK_N=kernels.BWD_TUNING[q.shape[-1]][1], **meta)
    _bwd_dq_cast_kernel[per_query](dq_sum, dq, *o.stride()[:3], *q.shape[1:3], sm_scale,
                                   HEAD_DIM=meta["HEAD_DIM"], BLOCK_M=meta["BLOCK_M"], **kernels.UNFUSED)
    return dq, dk, dv


class _AttentionWithBackward(torch.autograd.Function):
    """kernels.flash_attention's forward with one of this file's backwards, called as kernels.flash_bwd_op is
    (do, q, k, v, o, lse, causal, precision, from_p, fma)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, fix, numerics, backward):
        o, lse, o_delta = kernels.forward(q, k, v, causal=causal, fix=fix, numerics=numerics)
        ctx.save_for_backward(q, k, v, o_delta if o_delta.numel() else o, lse)   # the O that delta will read
        ctx.args = (causal, numerics.precision, numerics.delta == "p", numerics.fma)
        ctx.run_backward = backward
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*ctx.run_backward(do, q, k, v, o, lse, *ctx.args), None, None, None, None)


def one_pass_attention(q, k, v, causal=True, fix="on", numerics=None, ordered=False):
    """kernels.flash_attention with the one-pass backward; ordered: its dQ in the two-pass backward's order,
    the same bits every run (the section "dQ in a fixed order")."""
    numerics = Numerics() if numerics is None else numerics
    return _AttentionWithBackward.apply(q, k, amplified_v(v, numerics.o_bits), causal, fix, numerics,
                                        partial(one_pass_backward, ordered=ordered))


# ---------------------------------------------------------------------------------------------------------
# The single-pass backward for short sequences
#
# At the training demo's length (seq 256) kernels.py's backward is three launches (delta, dK/dV, dQ), each only
# a few key tiles deep, and the eager step waits on the host more than on the GPU. Here the whole backward of one
# (batch, head) is one program, and all of it one launch:
#     1. delta = rowsum(dO * O) for every query tile, into kernels.py's fp32 delta buffer;
#     2. for each key tile j, ascending: for each query tile i it sees, ascending from the diagonal,
#            dV_j += P_ij^T dO_i      dK_j += dS_ij^T Q_i         (kernels._bwd_dkdv_tile: the dK/dV kernel's)
#            dQ_i += dS_ij K_j        (an fp32 buffer in O's layout, read back at the next key tile)
#     3. dQ = that sum * scale, cast, per query tile.
# Every sum runs in the two-pass backward's order: dK_j and dV_j over query tiles ascending (the dK/dV kernel's
# loop), dQ_i over key tiles ascending from zero (the dQ kernel's loop), each share added by the matrix product
# with the sum so far as its accumulator, as the dQ kernel's dq += dS K is. With the two-pass tiles (BLOCK_M x
# BLOCK_N of kernels.BWD_TUNING) that gives the two-pass backward's bits under the interpreter.
#
# Registers and shared memory do not depend on the length: a program holds one key tile's K, V, dK, dV and one
# query tile's operands, as the dK/dV kernel does, and dQ waits in global memory. The limit is the work per
# program and that buffer. One program per head runs all N^2 / (2 BLOCK_M BLOCK_N) causal pairs one after the
# other (36 at 512 keys, where the two-pass backward's longest program runs 8), and every pair reads and writes
# a BLOCK_M x head_dim fp32 tile of the buffer, fast only while the resident programs' buffers stay in L2:
# N x head_dim x 4 bytes per head, for two programs per SM at d64 and one at d128 (the sm_90 compile) 33 MiB
# on the H200's 132 SMs at 512 keys, within its 50 MiB of L2, and 66 MiB at 1024. So kernels.SHORT_SEQ, the
# length up to which kernels.py already treats a backward as short (one stage).
SINGLE_PASS_MAX_SEQ = kernels.SHORT_SEQ
# (BLOCK_M, BLOCK_N, warps, stages) per head_dim. The tiles are kernels.BWD_TUNING's: other tiles sum dK/dV over
# other query tiles and dQ over other key tiles, so other bits. Warps and stages from the sm_90 compile
# (results/speed/short_backward.md): no spill in the loop, 255 registers or fewer, and one stage, as kernels.py's
# backward at these lengths.
SINGLE_PASS_TUNING = {16: (64, 64, 4, 1), 32: (64, 64, 4, 1), 64: (64, 64, 4, 1), 128: (64, 64, 8, 1)}


@triton.jit
def _bwd_single_pass_kernel(Q, K, V, O, DO, LSE, DELTA, DQ_SUM, DQ, DK, DV,
                            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                            stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N,
                            qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr,
                            DELTA_FROM_O: tl.constexpr):
    # One program per (batch * head): grid (1, B * H). DQ_SUM: dQ's fp32 sum so far, in O's layout, read and
    # written by this program alone. DELTA_FROM_O: step 1 here; else DELTA holds the paper's control already
    # (kernels.bwd_delta's own pass over the keys).
    tl.static_assert(BLOCK_N % BLOCK_M == 0)      # so a key tile's diagonal starts on a query tile (below)
    tl.static_assert(DQ_SUM.dtype.element_ty == tl.float32)   # the shares summed in fp32, as in the dQ kernel
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh            # O, dO, the dQ buffer, dQ, dK and dV are in O's layout
    DO += b * stride_ob + h * stride_oh
    DQ_SUM += b * stride_ob + h * stride_oh
    DQ += b * stride_ob + h * stride_oh
    DK += b * stride_ob + h * stride_oh
    DV += b * stride_ob + h * stride_oh
    LSE += bh * N
    DELTA += bh * N
    offs_d = tl.arange(0, HEAD_DIM)
    if DELTA_FROM_O:
        # 1. delta = rowsum(dO * O) per query tile, kernels._bwd_delta_kernel's rows (a row's sum does not
        # depend on the tile). THE FIX (the cure, 4: the read): with fix "on" this O is the forward's fp32 O.
        for start_m in range(0, N, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            offs = rows[:, None] * stride_om + offs_d[None, :]
            o = tl.load(O + offs, mask=rows[:, None] < N, other=0.0)
            do = tl.load(DO + offs, mask=rows[:, None] < N, other=0.0)
            tl.store(DELTA + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < N)
        tl.debug_barrier()      # the stores above before any thread of the program reads delta below
    # 2. Key tiles ascending: each one's dK/dV loop as in kernels._bwd_dkdv_kernel, adding dQ's shares besides
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
        start = start_n if CAUSAL else 0          # queries above the diagonal see no key here
        for start_m in range(start, N, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            dk, dv, dsT = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, rows, cols, offs_d, stride_qm, stride_om,
                                         N, qk_scale, CAUSAL, AUTOCAST, FMA)
            # dQ_i += dS_ij K_j, the sum so far as the product's accumulator (the dQ kernel's dq += dS K); at key
            # tile 0 nothing is summed yet: zeros, the dQ kernel's start (the buffer needs no zeroing)
            out = rows[:, None] * stride_om + offs_d[None, :]
            dq = tl.load(DQ_SUM + out, mask=(rows[:, None] < N) & (start_n > 0), other=0.0)
            dq = tl.dot(tl.trans(dsT), k, dq)
            tl.store(DQ_SUM + out, dq, mask=rows[:, None] < N)
        out = cols[:, None] * stride_om + offs_d[None, :]
        tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols[:, None] < N)     # ROUND: dK
        tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols[:, None] < N)                  # ROUND: dV
        tl.debug_barrier()      # this key tile's dQ sums stored before the next one's loads, by any thread
    # 3. dQ = (the sum over key tiles of dS K) * scale, cast once, as the dQ kernel's
    for start_m in range(0, N, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        out = rows[:, None] * stride_om + offs_d[None, :]
        dq = tl.load(DQ_SUM + out, mask=rows[:, None] < N, other=0.0)
        tl.store(DQ + out, (dq * sm_scale).to(DQ.dtype.element_ty), mask=rows[:, None] < N)   # ROUND: dQ


def single_pass_backward(do, q, k, v, o, lse, causal, precision, from_p, fma, tuning=None):
    """kernels.flash_bwd_op's dQ, dK, dV in one launch, one program per (batch, head), for sequences up to
    SINGLE_PASS_MAX_SEQ (single_pass_attention checks it); tuning: in place of SINGLE_PASS_TUNING's. With
    from_p (the paper's control) delta is kernels.bwd_delta's pass over the keys first: two launches."""
    D = q.shape[-1]
    tuning = tuning or SINGLE_PASS_TUNING[D]
    do = kernels.dense_do(do, q, o)
    (_, (_, programs)), strides, meta = one_pass_launch(q, k, v, o, causal, precision, fma, tuning)
    meta["num_stages"] = tuning[3]      # the row's own, where kernels.bwd_launch makes short backwards one stage
    delta = kernels.bwd_delta(do, q, k, v, o, lse, causal, precision, True, fma) if from_p else torch.empty_like(lse)
    dq_sum = torch.empty_like(o, dtype=torch.float32)                      # o is dense: O's strides
    dq, dk, dv = (torch.empty_like(o, dtype=q.dtype) for _ in range(3))
    _bwd_single_pass_kernel[(1, programs)](q, k, v, o, do, lse, delta, dq_sum, dq, dk, dv, *strides, D ** -0.5,
                                           DELTA_FROM_O=not from_p, **meta)
    return dq, dk, dv


def single_pass_attention(q, k, v, causal=True, fix="on", numerics=None):
    """kernels.flash_attention with the single-pass backward, for sequences up to SINGLE_PASS_MAX_SEQ keys."""
    if q.shape[-2] > SINGLE_PASS_MAX_SEQ:
        raise ValueError(f"single_pass_attention takes up to {SINGLE_PASS_MAX_SEQ} keys (one program per head), "
                         f"got {q.shape[-2]}: use kernels.flash_attention")
    numerics = Numerics() if numerics is None else numerics
    return _AttentionWithBackward.apply(q, k, amplified_v(v, numerics.o_bits), causal, fix, numerics,
                                        single_pass_backward)


# ---------------------------------------------------------------------------------------------------------
# dQ in a fixed order (ordered=True)
#
# The atomics above add dQ_i's shares in whatever order the GPU runs the key tiles' programs; fp32 addition is
# not associative, so dQ's last bits change from run to run. Here each share waits for its turn, as in
# FlashAttention-3's deterministic backward (its dq_semaphore), and the turns follow the dQ kernel's sum
# (kernels._bwd_dq_kernel): dQ_i = sum of dS_ij K_j over the key tiles j ascending from 0, from zero.
# A semaphore per (batch, head, query tile i) counts the key tiles that have added their share to dQ_i; key tile
# j's program, at query tile i, waits until it reads j, reads dQ_i's fp32 partial sum, adds its share, stores
# it, and sets the semaphore to j + 1.
#   Why j: every key tile adds to every query tile (non-causal), or (causal) key tile j's loop starts on its own
#   diagonal, start_m = j * BLOCK_N (a query tile's first row: BLOCK_N % BLOCK_M == 0), so the key tiles that add
#   to dQ_i are 0, 1, ..., start_m // BLOCK_N. Both ways they are 0, 1, ... without a gap: j's turn comes after
#   exactly j others, and the semaphores end at cdiv(N, BLOCK_N), or start_m // BLOCK_N + 1.
#   Why the dQ kernel's bits: the share goes into the partial sum as the accumulator of its product
#   (tl.dot(a, b, acc)), over key tiles of the dQ kernel's size (DQ_BLOCK_N; a 128-key program's share is two
#   products of 64), just as the dQ kernel's `dq += tl.dot(...)` accumulates (on sm_90 both are chains of
#   wgmma over 16 keys each that accumulate in the MMA, no separate FADD; under the interpreter a product
#   exactly rounded, then added). The partial sum leaves registers only as fp32 through memory, unchanged. The
#   atomic path instead rounds each share's product alone and adds it with a RED (FTZ, FADD in L2).
#   Why it cannot deadlock: a program waits only for programs of the same (batch, head) with a smaller key tile,
#   program_id(0), which is innermost in the grid's linear order (x, then batch * head): they come earlier in
#   that order. A GPU dispatches a grid's programs in linear order (FA3 and CUTLASS's serial split-K rely on it
#   too), so when a program waits, those before it are running or done; the earliest unfinished program waits
#   for none that are unfinished, so it finishes, and by induction all do. Under Triton's interpreter the
#   programs run one after another, program_id(0) outermost (all of key tile j - 1's programs before any of j's),
#   so every wait finds its turn at the first read and never spins.
#   The cost: a program whose turn has not come idles (causal: key tile j starts once j - 1 has passed j's
#   diagonal, a wave across each head); dQ_i's partial sum is read and written back once per share; and Triton
#   does not pipeline a loop with a loop inside (the wait), so each query tile's Q and dO are loaded in its own
#   iteration (results/speed/backward_onepass.md, "dQ in a fixed order").

@triton.jit
def _add_dq_in_turn(DQ, SEM, dsT, k, rows, offs_d, stride_om, N, DQ_BLOCK_N: tl.constexpr):
    """dQ_i += dS_ij K_j into DQ (fp32, O's layout) for key tile j = program_id(0), after key tiles 0..j-1 and
    before j+1; SEM: dQ_i's semaphore, the number of key tiles that have added to it."""
    turn = tl.program_id(0)
    # Wait for the turn (acquire). The compare-and-swap writes back the value it read, so it only reads; Triton
    # runs a scalar atomic in one thread and hands its result to every thread of the program through shared
    # memory and a barrier, so they all loop together and all read dQ_i below after the acquire.
    while tl.atomic_cas(SEM, turn, turn, sem="acquire") != turn:
        pass
    # dQ_i's partial sum, from key tiles 0..j-1. volatile (ld.volatile): read from L2, past a line the SM's L1
    # may hold from an earlier turn, and never moved ahead of the wait by the compiler
    ptrs = DQ + rows[:, None] * stride_om + offs_d[None, :]
    dq = tl.load(ptrs, mask=rows[:, None] < N, other=0.0, volatile=True)
    # dQ_i += dS_ij K_j (times the scale at the cast), the partial sum as the products' accumulator: the dQ
    # kernel's loop body, once per key tile of its size
    BLOCK_N: tl.constexpr = dsT.shape[0]
    tl.static_assert(BLOCK_N == DQ_BLOCK_N or BLOCK_N == 2 * DQ_BLOCK_N)
    if BLOCK_N == DQ_BLOCK_N:
        dq = tl.dot(tl.trans(dsT), k, dq)
    else:
        ds_first, ds_second = _key_halves(dsT)
        k_first, k_second = _key_halves(k)
        dq = tl.dot(tl.trans(ds_first), k_first, dq)
        dq = tl.dot(tl.trans(ds_second), k_second, dq)
    tl.store(ptrs, dq, mask=rows[:, None] < N)
    # Pass the turn on (release): the barrier waits until every warp of the program has stored its part of dQ_i,
    # the release makes those stores visible to the GPU before the semaphore moves. An exchange, not an add:
    # it sets a value, right however many threads perform it.
    tl.debug_barrier()
    tl.atomic_xchg(SEM, turn + 1, sem="release")


@triton.jit
def _key_halves(x):
    """A tile of keys x (keys as rows) as its first and its second half of the keys."""
    ROWS: tl.constexpr = x.shape[0]
    COLS: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, [2, ROWS // 2, COLS]), [1, 2, 0]))


def dq_semaphores(o, block_m):
    """The ordered dQ's semaphores: int32 zeros, one per (batch, head, query tile of block_m rows), each counting
    the key tiles that have added their share to that query tile's dQ. New zeros per call (a few bytes)."""
    B, H, N, _ = o.shape
    return torch.zeros((B, H, triton.cdiv(N, block_m)), dtype=torch.int32, device=o.device)
