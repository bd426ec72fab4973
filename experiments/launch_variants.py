"""kernels.py's launches in settings other than its own, for the experiments that time and compile them
(tuning.py, forward_split.py, backward_variants.py, sass.py, bench.py): other tiles, warps and stages (tuned),
the one-pass backward (one_pass_attention), a persistent forward (persistent_attention) and score tiles of
128 keys (wide_attention).

The one-pass backward sums dQ in the dK/dV pass: each key tile's program adds dQ_i += dS_ij K_j into an fp32
buffer in O's layout, by fp32 atomics or by TMA reductions (DQ_TMA), and _bwd_dq_cast_kernel scales and casts
it; 5 matrix products per tile pair instead of kernels.py's 7, at most 8-10% faster, but dQ's last bits follow
the GPU's order of programs (docs/kernel.md, "Which backward is the default"). Its delta is kernels.py's
(kernels.bwd_delta, the two-pass tiles), so both backwards read the same delta.

The persistent forward launches as many programs as the GPU holds at once, each looping over work items (query
tile, batch * head) and computing each one as kernels._fwd_kernel's program for it does (kernels._fwd_tile): the
same bits, in another order of programs (results/speed/persistent_forward.md).
"""
import functools
import types
from contextlib import contextmanager

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import kernels
from kernels import _bwd_dkdv_tile, _fwd_inner, _fwd_tile, _fwd_update, _scores
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
        ctx.save_for_backward(q, k, v, o_delta if o_delta.numel() else o, lse)   # the O that delta will read
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


# ---------------------------------------------------------------------------------------------------------
# A persistent forward

# The grid: SMs x programs per SM, the most the GPU runs at once, so none waits for a second wave. Per head_dim,
# (programs per SM, register cap or None): what the sm_90 compile of FWD_TUNING's setting leaves room for on one SM
# (python -m experiments.sass --persistent, results/speed/persistent_forward.md). The loop over work items costs
# registers: at head_dim 64 the persistent kernel takes 164-199 (kernels.py's 114-127), one program per SM, so it
# is capped at 128 (no spills with fix "off", 8 bytes with fix "on") to run two, as kernels.py's forward does.
# STAND_IN_SMS: the SMs counted where no GPU answers (the interpreter, the compile on a CPU): an H100's or H200's.
PERSISTENT_TUNING = {16: (2, None), 32: (2, None), 64: (2, 128), 128: (1, None)}
STAND_IN_SMS = 132


@triton.jit
def _fwd_persistent_kernel(Q, K, V, O, O32, LSE,
                           stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                           stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N, qk_scale, BH,
                           HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, SHIFT: tl.constexpr, P_BITS: tl.constexpr,
                           O_BITS: tl.constexpr, FMA: tl.constexpr, KEEP_O32: tl.constexpr):
    # kernels._fwd_kernel's arguments and BH = batch * heads; any number of programs. Work item w is query tile
    # tiles - 1 - w // BH of batch * head w % BH: the heaviest tiles (causal: the most keys) of every head first,
    # then the next lighter, so each round of G consecutive items (G programs, one item each) holds tiles of
    # about one weight and the lightest come last, where they even out the programs' ends. Rounds alternate
    # direction (program p takes the round's p-th item, then its p-th from the end), so the program that got
    # the round's heaviest item gets the next round's lightest: the programs' totals differ by about one tile.
    tiles = tl.cdiv(N, BLOCK_M)
    items = tiles * BH
    G = tl.num_programs(0)
    p = tl.program_id(0)
    for r in range(0, tl.cdiv(items, G)):
        w = r * G + tl.where(r % 2 == 0, p, G - 1 - p)
        if w < items:   # (the last round may be short)
            _fwd_tile(Q, K, V, O, O32, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                      stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N, qk_scale,
                      tiles - 1 - w // BH, (w % BH).to(tl.int64),
                      HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, AUTOCAST, SHIFT, P_BITS, O_BITS, FMA, KEEP_O32)


def resident_programs(device, head_dim):
    """The persistent grid's size: the GPU's SMs (STAND_IN_SMS off a GPU) x PERSISTENT_TUNING's programs per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else STAND_IN_SMS
    return sms * PERSISTENT_TUNING[head_dim][0]


class _PersistentLaunch:
    """Stands in for kernels._fwd_kernel: its launch on grid (query tiles, batch * heads) runs
    _fwd_persistent_kernel on min(programs, work items) programs (programs None: resident_programs'), with
    PERSISTENT_TUNING's register cap."""

    def __init__(self, programs):
        self.programs = programs

    def __getitem__(self, grid):
        tiles, bh = grid

        def launch(*args, **meta):
            programs = self.programs or resident_programs(args[0].device, meta["HEAD_DIM"])
            maxnreg = PERSISTENT_TUNING[meta["HEAD_DIM"]][1]
            _fwd_persistent_kernel[(min(programs, tiles * bh),)](*args, bh, **meta,
                                                                 **({} if maxnreg is None else dict(maxnreg=maxnreg)))
        return launch


@contextmanager
def persistent(programs=None):
    """kernels.py's forward launches inside the block run persistent, on `programs` programs (None: as many as
    the GPU holds at once, resident_programs); its backward is unchanged."""
    saved = kernels._fwd_kernel
    kernels._fwd_kernel = _PersistentLaunch(programs)
    try:
        yield
    finally:
        kernels._fwd_kernel = saved


def persistent_attention(q, k, v, causal=True, fix="on", numerics=None, programs=None):
    """kernels.flash_attention with the persistent forward (the same bits; its backward as it is)."""
    with persistent(programs):
        return kernels.flash_attention(q, k, v, causal=causal, fix=fix, numerics=numerics)


# ---------------------------------------------------------------------------------------------------------
# Score tiles of 128 keys
#
# kernels.py's key loop computes S = Q_i K_j^T for 64 keys at a time (TILE_N: one wgmma of N = 64). This variant
# loads 128 keys per iteration and computes their S in one product (N = 128: Q read from shared memory once per
# 128 keys, half the loop's iterations), then runs the recurrence over the two 64-key halves exactly as two of
# kernels.py's iterations do (kernels._fwd_update, half 0 then half 1, each P V_j with its own half of V). So the
# numerics stay TILE_N's: the shift's tie test (kernels._shifted_max) sees a max in both halves as a tie across
# tiles, as today, and O, lse and the fp32 O keep kernels.py's bits (nanolp/emulate.py is unchanged).


@triton.jit
def _fwd_inner_wide(acc, l_i, m_i, t_i, q, K, V, stride_kn, stride_vn, start, stop, offs_m, offs_n, offs_d, N,
                    qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr,
                    SHIFT: tl.constexpr, P_BITS: tl.constexpr, FMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """kernels._fwd_inner (its arguments, its results) with the unmasked key tiles taken two at a time: pairs
    of 64-key tiles up to the last whole pair, then an odd last tile (non-causal; or causal with query tiles of
    64, the interpreter's) on kernels.py's path. The masked tiles (the diagonal, the ragged last tile) stay
    kernels.py's: the unmasked loop is where a program spends almost all its tiles at long sequences."""
    if not MASKED:
        WIDE: tl.constexpr = 2 * BLOCK_N
        BLOCK_M: tl.constexpr = offs_m.shape[0]
        stop_pairs = start + (stop - start) // WIDE * WIDE
        offs_w = tl.arange(0, WIDE)
        for start_n in range(start, stop_pairs, WIDE):
            kT = tl.load(K + offs_d[:, None] + (start_n + offs_w)[None, :] * stride_kn)
            v0 = tl.load(V + (start_n + offs_n)[:, None] * stride_vn + offs_d[None, :])
            v1 = tl.load(V + (start_n + BLOCK_N + offs_n)[:, None] * stride_vn + offs_d[None, :])
            # S = Q_i [K_j K_j+1]^T in one product, split into the two tiles' S: column h * 64 + c of the 128
            # is column c of half h (reshape), the halves' axis moved last (permute) and split off
            s = _scores(q, kT, qk_scale, AUTOCAST)
            s0, s1 = tl.split(tl.permute(tl.reshape(s, [BLOCK_M, 2, BLOCK_N]), [0, 2, 1]))
            acc, l_i, m_i, t_i = _fwd_update(acc, l_i, m_i, t_i, s0, v0, q, qk_scale, AUTOCAST, SHIFT, P_BITS, FMA)
            acc, l_i, m_i, t_i = _fwd_update(acc, l_i, m_i, t_i, s1, v1, q, qk_scale, AUTOCAST, SHIFT, P_BITS, FMA)
        start = stop_pairs
    return _fwd_inner(acc, l_i, m_i, t_i, q, K, V, stride_kn, stride_vn, start, stop, offs_m, offs_n, offs_d, N,
                      qk_scale, MASKED, CAUSAL, AUTOCAST, SHIFT, P_BITS, FMA, BLOCK_N)


def _with_globals(kernel, **names):
    """kernel's own source, compiled with these names bound in its globals: a new JIT function (its own cache),
    so kernels.py's kernel and its compiled code stay as they are."""
    fn = kernel.fn
    rebound = types.FunctionType(fn.__code__, {**fn.__globals__, **names}, fn.__name__, fn.__defaults__)
    return triton.jit(functools.update_wrapper(rebound, fn))      # with fn's annotations: its tl.constexpr


# kernels.py's forward kernel whose key loop (kernels._fwd_inner, which kernels._fwd_tile calls) is _fwd_inner_wide
_fwd_kernel_wide = _with_globals(kernels._fwd_kernel,
                                 _fwd_tile=_with_globals(_fwd_tile, _fwd_inner=_fwd_inner_wide))


# Pipeline stages in place of kernels.FWD_TUNING's for wide_attention: K's tiles of 128 keys double the shared memory
# each stage holds, and at d128 FWD_TUNING's 4 stages would need 289 KiB, over the 227 an H200 CTA can have
# (results/speed/wide_tiles.md)
WIDE_STAGES = {128: 3}


@contextmanager
def wide():
    """kernels.py's forwards inside the block compute S for 128 keys at a time (_fwd_inner_wide), with the same
    bits, at the tuning in force (tuned; wide_attention's: WIDE_STAGES)."""
    saved = kernels._fwd_kernel
    kernels._fwd_kernel = _fwd_kernel_wide
    try:
        yield
    finally:
        kernels._fwd_kernel = saved


def wide_attention(q, k, v, causal=True, fix="on", numerics=None):
    """kernels.flash_attention with score tiles of 128 keys in the forward (wide) at WIDE_STAGES' stages (the
    interpreter ignores stages); the backward is kernels.py's."""
    stages = {D: (*kernels.FWD_TUNING[D][:2], n) for D, n in WIDE_STAGES.items()}
    with wide(), tuned(fwd=stages):
        return kernels.flash_attention(q, k, v, causal=causal, fix=fix, numerics=numerics)
