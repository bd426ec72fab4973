"""The forward of kernels.py in Gluon for Hopper (sm_90): the same algorithm, the same fix, written with the
pieces Triton's compiler does not let kernels.py place itself (shared memory, warpgroup MMAs, TMA, mbarriers).

    from experiments.kernels_gluon import forward
    o, lse, o32 = forward(q, k, v, fix="on", causal=True)      # CUDA sm_90; head_dim 64 or 128; bf16/fp16

kernels.py is the specification: each stage below names the piece of kernels.py it implements. Outputs are
kernels.forward's: O in q's dtype and layout, lse in fp32 (log2 units: m + log2 l, "fa2" precision), and the O
delta reads: with fix="on" the fp32 O before its final cast (THE FIX's store, KEEP_O32), else O itself
(fix="paper": the paper's rule); "fa2" numerics only (the production rounding: the exponent one fma, no
amplifier).

Four variants (VARIANTS), each one program per 128 query rows (two warpgroups of 64), key tiles of 64:
    "sync": K and V read by plain loads into shared memory; each warpgroup MMA waited on at once. The likely-correct
            baseline.
    "tma":  K/V tiles brought by TMA into a two-slot ring guarded by mbarriers, the copy of tile j + 2 in flight
            while tile j + 1 is computed; Q by TMA; the MMAs issued asynchronously, each waited on explicitly.
    "ws":   FlashAttention-3's structure by warp specialization: a loader warp fills the K/V ring by TMA, and two
            consumer warpgroups (partitions of 4 warps, 64 rows each) each hand a slot back by an mbarrier.
    "overlap": "ws" with the consumer warpgroups taking turns on the tensor cores (FlashAttention-3's ping-pong),
            each handing the turn over once its MMAs are issued, S waited for apart from the P V MMA, and a
            four-slot K/V ring.
Without a GPU the kernels compile for sm_90 (experiments/compile_gluon_sm90.py); Triton's interpreter cannot run Gluon.
Not in flash_attention's path: at head_dim 128, seq 4k-16k, no variant passed 1.15x kernels.py's forward, short
of the 15% that a Gluon backward would need to be worth it (docs/kernel.md, "Speed").
"""
import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                               warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kernels import Numerics, TILE_N, UNFUSED, check_inputs, empty_in_layout_of, fix_constants, qk_scale_of

BLOCK_N = gl.constexpr(TILE_N)    # keys per tile (the shift looks for ties within one tile)
# (BLOCK_M, warps at launch); "ws": 4 warps (a consumer warpgroup), plus its partitions: 4 warps and a loader warp
VARIANTS = {"sync": (128, 8), "tma": (128, 8), "ws": (128, 4), "overlap": (128, 4)}
NAN_ALL = gl.constexpr(tl.PropagateNan.ALL)    # kernels._top2's: -inf is the identity of the second's maxima
# a barrier across the CTA's warps: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
# a TMA copy of a tile into shared memory: tma.async_copy_global_to_shared in 3.6, tma.async_load from 3.7 on
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


# ---------------------------------------------------------------------------------------------------------
# Layouts: S and O accumulate in the wgmma register layout, one 64-row slab per warpgroup; P is fed to the
# second MMA from registers; Q, K, V sit in shared memory in the swizzled layout wgmma and TMA read.

@gluon.constexpr_function
def mma_layout(num_warps, n):
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def load_layout(num_warps, head_dim):
    # 16 bytes per thread along head_dim, rows across the rest of the warp and the warps
    return gl.BlockedLayout([1, 8], [32 * 8 // head_dim, head_dim // 8], [num_warps, 1], [1, 0])


# ---------------------------------------------------------------------------------------------------------
# Per-tile softmax: kernels._fwd_inner's "fa2" branch, and the paper's rule's _shifted_max (with _top2 and _fold).

@gluon.jit
def _top2(a1, a2, b1, b2):
    """kernels._top2: (largest, second largest) of a row, an equal value counted twice."""
    return gl.maximum(a1, b1), gl.maximum(gl.minimum(a1, b1), gl.maximum(a2, b2, NAN_ALL), NAN_ALL)


@gluon.jit
def _fold(d, SHIFT: gl.constexpr):
    """kernels._fold: lo + fmod(d, span) without a division (the same float64 steps, the same bits)."""
    d64 = d.to(gl.float64)
    n = gl.floor(d64 * gl.full([], SHIFT.inv, gl.float64))
    rem = d64 - n * gl.full([], SHIFT.span, gl.float32).to(gl.float64)
    return SHIFT.lo + rem.to(gl.float32)                                  # ROUND: lo + fmod(d, span)


@gluon.jit
def _shifted_max(s, scale, t, SHIFT: gl.constexpr):
    """kernels._shifted_max: the row max to subtract, a tied row's moved up by d = |r| folded into [lo, hi)."""
    r, r2 = gl.reduce((s, gl.full(s.shape, float("-inf"), gl.float32, s.type.layout)), 1, _top2)
    r, r2 = r * scale, r2 * scale                                                      # ROUND: as S's scale
    across = (r >= t - SHIFT.tol) & (t >= r - SHIFT.tol)
    tied = ((r2 >= r - SHIFT.tol) | across) & (r > float("-inf"))
    d = gl.abs(r)
    d = gl.where((d >= SHIFT.lo) & (d < SHIFT.hi), d, _fold(d, SHIFT))
    return gl.where(tied, r + d, r), gl.maximum(t, r)                                  # ROUND: r + d


@gluon.jit
def _softmax_step(s, m_i, l_i, t_i, qk_scale, SHIFT: gl.constexpr):
    """From S = Q K^T of one tile (fp32, masked): m' = max(m, rowmax(S)) (shifted with the fix), P = 2^(S scale
    - m') with one fma (kernels._exp2), alpha = 2^(m - m'), l = alpha l + rowsum(P)."""
    if SHIFT is None:
        r = gl.max(s, 1) * qk_scale                                                    # ROUND: as S's scale
    else:
        r, t_i = _shifted_max(s, qk_scale, t_i, SHIFT)
    m_new = gl.maximum(m_i, r)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(gl.fma(s, qk_scale, -m_new[:, None]))                                  # ROUND: once
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i, t_i


@gluon.jit
def _mask(s, offs_m, cols, N, CAUSAL: gl.constexpr):
    """kernels._fwd_inner's MASKED tiles: keys past N and, causal, keys right of the diagonal, to -inf."""
    valid = cols[None, :] < N
    if CAUSAL:
        valid = valid & (offs_m[:, None] >= cols[None, :])
    return gl.where(valid, s, float("-inf"))


@gluon.jit
def _epilogue(acc, l_i, m_i, O, O32, LSE, offs_m_o, offs_m, stride_om, N, HEAD_DIM: gl.constexpr,
              o_layout: gl.constexpr, KEEP_O32: gl.constexpr):
    """kernels._fwd_kernel's end: O = acc / l cast to the input dtype, the fp32 O beside it (KEEP_O32, THE FIX),
    lse = m + log2 l."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    o = acc / l_o[:, None]
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = offs_m_o[:, None] * stride_om + offs_d[None, :]
    rows = offs_m_o[:, None] < N
    gl.store(O + ptrs, o.to(O.dtype.element_ty), mask=rows)                            # ROUND: O
    if KEEP_O32:
        gl.store(O32 + ptrs, o, mask=rows)
    gl.store(LSE + offs_m, m_i + gl.log2(l_i), mask=offs_m < N)


# ---------------------------------------------------------------------------------------------------------
# Variant "sync": kernels._fwd_kernel with plain loads into shared memory and each MMA waited on at once.

@gluon.jit
def _load_tile(smem, base, rows, stride, N, MASKED: gl.constexpr, HEAD_DIM: gl.constexpr,
               layout: gl.constexpr):
    offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, layout))
    ptrs = base + rows[:, None] * stride + offs_d[None, :]
    if MASKED:
        x = gl.load(ptrs, mask=rows[:, None] < N, other=0.0)
    else:
        x = gl.load(ptrs)
    smem.store(x)


@gluon.jit
def _sync_inner(acc, l_i, m_i, t_i, q_smem, k_smem, v_smem, K, V, stride_kn, stride_vn, start, stop, offs_m,
                N, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
                HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """kernels._fwd_inner over key tiles [start, stop)."""
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
    ld: gl.constexpr = load_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    for start_n in range(start, stop, BLOCK_N):
        cta_barrier()                      # both warpgroups are done reading the last tile
        rows = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        _load_tile(k_smem, K, rows, stride_kn, N, MASKED, HEAD_DIM, ld)
        _load_tile(v_smem, V, rows, stride_vn, N, MASKED, HEAD_DIM, ld)
        fence_async_shared()
        cta_barrier()
        # S = Q_i K_j^T (fp32 accumulate of bf16 products; kernels._scores)
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False)
        if MASKED:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = _mask(s, offs_m, cols, N, CAUSAL)
        p, alpha, m_i, l_i, t_i = _softmax_step(s, m_i, l_i, t_i, qk_scale, SHIFT)
        # acc = exp(m - m') acc + P V_j
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p.to(K.dtype.element_ty), p_layout)                        # ROUND: P to bf16
        acc = warpgroup_mma(p, v_smem, acc)
    return acc, l_i, m_i, t_i


@gluon.jit
def _fwd_sync(Q, K, V, O, O32, LSE, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N, qk_scale,
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
              KEEP_O32: gl.constexpr, num_warps: gl.constexpr):
    # kernels._fwd_kernel: one program per (query tile, batch * head), heaviest query tiles first
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
    ld: gl.constexpr = load_layout(num_warps, HEAD_DIM)
    dtype: gl.constexpr = Q.dtype.element_ty
    bh = gl.program_id(1).to(gl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    O32 += b * stride_ob + h * stride_oh
    LSE += bh * N
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_M, HEAD_DIM], dtype))
    kv_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], dtype)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], kv_layout)
    _load_tile(q_smem, Q, start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ld)), stride_qm, N, True,
               HEAD_DIM, ld)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    t_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if CAUSAL:
        stop_unmasked = start_m
        stop = gl.minimum(start_m + BLOCK_M, N)
    else:
        stop_unmasked = (N // BLOCK_N) * BLOCK_N
        stop = N
    acc, l_i, m_i, t_i = _sync_inner(acc, l_i, m_i, t_i, q_smem, k_smem, v_smem, K, V, stride_kn, stride_vn,
                                     0, stop_unmasked, offs_m, N, qk_scale, False, CAUSAL, SHIFT, HEAD_DIM,
                                     BLOCK_M, num_warps)
    acc, l_i, m_i, t_i = _sync_inner(acc, l_i, m_i, t_i, q_smem, k_smem, v_smem, K, V, stride_kn, stride_vn,
                                     stop_unmasked, stop, offs_m, N, qk_scale, True, CAUSAL, SHIFT, HEAD_DIM,
                                     BLOCK_M, num_warps)
    offs_m_o = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    _epilogue(acc, l_i, m_i, O, O32, LSE, offs_m_o, offs_m, stride_om, N, HEAD_DIM, o_layout, KEEP_O32)


# ---------------------------------------------------------------------------------------------------------
# Variant "tma": K/V tiles by TMA into a two-slot ring (mbarriers say a slot has landed), the copy of tile j + 2
# in flight while tile j + 1 is computed; Q by TMA; the MMAs issued asynchronously, each waited on explicitly.

@gluon.jit
def _tma_inner(acc, l_i, m_i, t_i, it, q_smem, k_ring, v_ring, bars, k_desc, v_desc, b, h, start, stop, n_tiles,
               offs_m, N, qk_scale, MASKED: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, num_warps: gl.constexpr):
    """kernels._fwd_inner over key tiles [start, stop); it counts the tiles of both loops (the ring's position)."""
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    for start_n in range(start, stop, BLOCK_N):
        slot = it % 2
        mbarrier.wait(bars.index(slot), (it // 2) & 1)
        k_smem = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_smem = v_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=[s, q_smem, k_smem])
        if MASKED:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = _mask(s, offs_m, cols, N, CAUSAL)
        p, alpha, m_i, l_i, t_i = _softmax_step(s, m_i, l_i, t_i, qk_scale, SHIFT)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p.to(k_desc.dtype), p_layout)                               # ROUND: P to bf16
        acc = warpgroup_mma(p, v_smem, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=[acc, v_smem])
        # the slot is free once both warpgroups are done with it: refill it with tile it + 2
        cta_barrier()
        _tma_kv(k_desc, v_desc, k_ring, v_ring, bars, slot, b, h, (it + 2) * BLOCK_N, it + 2 < n_tiles)
        it += 1
    return acc, l_i, m_i, t_i, it


@gluon.jit
def _tma_kv(k_desc, v_desc, k_ring, v_ring, bars, slot, b, h, start_n, pred):
    bar = bars.index(slot)
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [b, h, start_n, 0], bar, k_ring.index(slot), pred=pred)
    tma_load(v_desc, [b, h, start_n, 0], bar, v_ring.index(slot), pred=pred)


@gluon.jit
def _fwd_tma(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale,
             HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
             KEEP_O32: gl.constexpr, num_warps: gl.constexpr):
    # kernels._fwd_kernel: one program per (query tile, batch * head), heaviest query tiles first
    s_layout: gl.constexpr = mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)
    dtype: gl.constexpr = q_desc.dtype
    pid_bh = gl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    bh = pid_bh.to(gl.int64)
    O += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    O32 += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    LSE += bh * N
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    # shared memory in the descriptors' 4-d tiles (1, 1, rows, head_dim), viewed 2-d by the MMAs
    q_tile = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, HEAD_DIM], q_desc.layout)
    q_smem = q_tile.reshape([BLOCK_M, HEAD_DIM])
    k_ring = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [2, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [3, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(3):
        mbarrier.init(bars.index(i), count=1)
    if CAUSAL:
        stop_unmasked = start_m
        stop = gl.minimum(start_m + BLOCK_M, N)
    else:
        stop_unmasked = (N // BLOCK_N) * BLOCK_N
        stop = N
    n_tiles = gl.cdiv(stop, BLOCK_N)
    q_bar = bars.index(2)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, start_m, 0], q_bar, q_tile)
    _tma_kv(k_desc, v_desc, k_ring, v_ring, bars, 0, b, h, 0, n_tiles > 0)
    _tma_kv(k_desc, v_desc, k_ring, v_ring, bars, 1, b, h, BLOCK_N, n_tiles > 1)
    mbarrier.wait(q_bar, 0)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    t_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    it = 0
    acc, l_i, m_i, t_i, it = _tma_inner(acc, l_i, m_i, t_i, it, q_smem, k_ring, v_ring, bars, k_desc, v_desc, b, h,
                                        0, stop_unmasked, n_tiles, offs_m, N, qk_scale, False, CAUSAL, SHIFT,
                                        HEAD_DIM, BLOCK_M, num_warps)
    acc, l_i, m_i, t_i, it = _tma_inner(acc, l_i, m_i, t_i, it, q_smem, k_ring, v_ring, bars, k_desc, v_desc, b, h,
                                        stop_unmasked, stop, n_tiles, offs_m, N, qk_scale, True, CAUSAL, SHIFT,
                                        HEAD_DIM, BLOCK_M, num_warps)
    for i in gl.static_range(3):
        mbarrier.invalidate(bars.index(i))
    offs_m_o = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    _epilogue(acc, l_i, m_i, O, O32, LSE, offs_m_o, offs_m, stride_om, N, HEAD_DIM, o_layout, KEEP_O32)


# ---------------------------------------------------------------------------------------------------------
# Variant "ws": warp specialization, FlashAttention-3's structure. A loader warp brings K/V tiles by TMA into a
# two-slot ring; two consumer warpgroups (partitions of 4 warps), 64 query rows each of a 128-row tile, run the
# loop of kernels._fwd_inner on their rows, each handing a slot back (kv_empty) once its P V MMA is done. The
# warp schedulers interleave the two warpgroups' MMAs and softmaxes (no explicit ping-pong order yet).

WS_STAGES = gl.constexpr(2)


@gluon.jit
def _ws_loader(k_desc, v_desc, k_ring, v_ring, kv_ready, kv_empty, b, h, n_tiles, STAGES: gl.constexpr):
    for it in range(n_tiles):
        slot = it % STAGES
        # the slot's previous tile (it - STAGES) must be released by both consumers
        mbarrier.wait(kv_empty.index(slot), ((it // STAGES) & 1) ^ 1, pred=it >= STAGES)
        bar = kv_ready.index(slot)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma_load(k_desc, [b, h, it * BLOCK_N, 0], bar, k_ring.index(slot))
        tma_load(v_desc, [b, h, it * BLOCK_N, 0], bar, v_ring.index(slot))


@gluon.jit
def _ws_inner(acc, l_i, m_i, t_i, it, q_smem, k_ring, v_ring, kv_ready, kv_empty, start, stop, offs_m, N, qk_scale,
              MASKED: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr, HEAD_DIM: gl.constexpr):
    """kernels._fwd_inner over key tiles [start, stop), for one warpgroup's 64 rows."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    for start_n in range(start, stop, BLOCK_N):
        slot = it % WS_STAGES
        mbarrier.wait(kv_ready.index(slot), (it // WS_STAGES) & 1)
        k_smem = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_smem = v_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_smem, k_smem.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        s, _, _ = warpgroup_mma_wait(0, deps=[s, q_smem, k_smem])
        if MASKED:
            cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            s = _mask(s, offs_m, cols, N, CAUSAL)
        p, alpha, m_i, l_i, t_i = _softmax_step(s, m_i, l_i, t_i, qk_scale, SHIFT)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p = gl.convert_layout(p.to(q_smem.dtype), p_layout)                                # ROUND: P to bf16
        acc = warpgroup_mma(p, v_smem, acc, is_async=True)
        acc, _ = warpgroup_mma_wait(0, deps=[acc, v_smem])
        cta_barrier()                            # the warpgroup's four warps are done with the slot
        mbarrier.arrive(kv_empty.index(slot), count=1)
        it += 1
    return acc, l_i, m_i, t_i, it


@gluon.jit
def _ws_consumer(WG: gl.constexpr, q_desc, q_smem, q_bar, k_ring, v_ring, kv_ready, kv_empty, O, O32, LSE, b, h,
                 start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM: gl.constexpr, CAUSAL: gl.constexpr,
                 SHIFT: gl.constexpr, KEEP_O32: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    rows0 = start_m + WG * 64
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, rows0, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    q2d = q_smem.reshape([64, HEAD_DIM])
    offs_m = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    t_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    it = 0
    acc, l_i, m_i, t_i, it = _ws_inner(acc, l_i, m_i, t_i, it, q2d, k_ring, v_ring, kv_ready, kv_empty, 0,
                                       stop_unmasked, offs_m, N, qk_scale, False, CAUSAL, SHIFT, HEAD_DIM)
    acc, l_i, m_i, t_i, it = _ws_inner(acc, l_i, m_i, t_i, it, q2d, k_ring, v_ring, kv_ready, kv_empty,
                                       stop_unmasked, stop, offs_m, N, qk_scale, True, CAUSAL, SHIFT, HEAD_DIM)
    offs_m_o = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    _epilogue(acc, l_i, m_i, O, O32, LSE, offs_m_o, offs_m, stride_om, N, HEAD_DIM, o_layout, KEEP_O32)


@gluon.jit
def _fwd_ws(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale,
            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
            KEEP_O32: gl.constexpr, num_warps: gl.constexpr):
    _ws_kernel(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale, HEAD_DIM, BLOCK_M,
               CAUSAL, SHIFT, KEEP_O32, 0, WS_STAGES)


@gluon.jit
def _fwd_overlap(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale,
                 HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
                 KEEP_O32: gl.constexpr, num_warps: gl.constexpr):
    _ws_kernel(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale, HEAD_DIM, BLOCK_M,
               CAUSAL, SHIFT, KEEP_O32, 1, OV_STAGES)


@gluon.jit
def _ws_kernel(q_desc, k_desc, v_desc, O, O32, LSE, stride_ob, stride_oh, stride_om, H, N, qk_scale,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, SHIFT: gl.constexpr,
               KEEP_O32: gl.constexpr, MODE: gl.constexpr, STAGES: gl.constexpr):
    # kernels._fwd_kernel: one program per (query tile, batch * head), heaviest first; q_desc in 64-row tiles.
    # MODE 0: "ws"'s consumers, 1: "overlap"'s; STAGES: the K/V ring's slots
    gl.static_assert(BLOCK_M == 128)
    dtype: gl.constexpr = q_desc.dtype
    pid_bh = gl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    O += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    O32 += b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
    LSE += pid_bh.to(gl.int64) * N
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    q0 = gl.allocate_shared_memory(dtype, [1, 1, 64, HEAD_DIM], q_desc.layout)
    q1 = gl.allocate_shared_memory(dtype, [1, 1, 64, HEAD_DIM], q_desc.layout)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, HEAD_DIM], v_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(kv_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)          # one arrival from each consumer warpgroup
    for i in gl.static_range(2):
        mbarrier.init(q_bars.index(i), count=1)
    if MODE != 0:
        turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(turns.index(i), count=1)
        mbarrier.arrive(turns.index(0), count=1)       # warpgroup 0 takes the first turn
    if CAUSAL:
        stop_unmasked = start_m
        stop = gl.minimum(start_m + BLOCK_M, N)
    else:
        stop_unmasked = (N // BLOCK_N) * BLOCK_N
        stop = N
    n_tiles = gl.cdiv(stop, BLOCK_N)
    # (the arguments inline: a tuple assigned to a name would turn its constexprs into tensors)
    if MODE == 1:
        gl.warp_specialize([
            (_ov_consumer, (0, q_desc, q0, q_bars.index(0), k_ring, v_ring, kv_ready, kv_empty, turns, O, O32, LSE,
                            b, h, start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM, CAUSAL, SHIFT,
                            KEEP_O32, STAGES)),
            (_ov_consumer, (1, q_desc, q1, q_bars.index(1), k_ring, v_ring, kv_ready, kv_empty, turns, O, O32, LSE,
                            b, h, start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM, CAUSAL, SHIFT,
                            KEEP_O32, STAGES)),
            (_ws_loader, (k_desc, v_desc, k_ring, v_ring, kv_ready, kv_empty, b, h, n_tiles, STAGES)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_ws_consumer, (0, q_desc, q0, q_bars.index(0), k_ring, v_ring, kv_ready, kv_empty, O, O32, LSE, b, h,
                            start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM, CAUSAL, SHIFT, KEEP_O32)),
            (_ws_consumer, (1, q_desc, q1, q_bars.index(1), k_ring, v_ring, kv_ready, kv_empty, O, O32, LSE, b, h,
                            start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM, CAUSAL, SHIFT, KEEP_O32)),
            (_ws_loader, (k_desc, v_desc, k_ring, v_ring, kv_ready, kv_empty, b, h, n_tiles, STAGES)),
        ], [4, 1], [240, 24])


# ---------------------------------------------------------------------------------------------------------
# Variant "overlap": "ws" with FlashAttention-3's ping-pong: the two consumer warpgroups take turns on the tensor
# cores (mbarriers turns[0], turns[1], handed back and forth). A plain ping-pong, handing the turn over once its
# MMAs are done, measured slower than "ws" (results/speed/gluon_forward.md): the tensor cores idled through every
# hand-over, and a two-slot ring released each slot just before the tile loaded into it was needed. Here, in its
# turn, a warpgroup issues the S MMA of tile it and then the P V MMA of tile it - 1 and hands the turn over at once
# (the other warpgroup's MMAs queue behind its own), waits for S alone (wgmma groups complete in order), runs tile
# it's softmax, and only then waits for the P V MMA, scales acc by tile it's alpha and casts P. (ptxas 3.6 still
# moves that last wait up to just before the exponentials, at head_dim 64 as at 128: not for want of registers.) acc
# is still alpha_j (acc) + P_j V_j tile after tile, kernels._fwd_inner's order: the same bits. The ring has four
# slots, so a tile is loaded two turns ahead of the turn that reads it.

OV_STAGES = gl.constexpr(4)


@gluon.jit
def _ov_softmax(s, start_n, stop_unmasked, offs_m, N, m_i, l_i, t_i, qk_scale, CAUSAL: gl.constexpr,
                SHIFT: gl.constexpr, HEAD_DIM: gl.constexpr):
    """kernels._fwd_inner's body after S, up to P in fp32 (its cast for the P V MMA is _ov_operand): the mask (tiles
    from stop_unmasked on) and the softmax step; acc left alone: alpha comes back in acc's rows."""
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    if start_n >= stop_unmasked:
        cols = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        s = _mask(s, offs_m, cols, N, CAUSAL)
    p, alpha, m_i, l_i, t_i = _softmax_step(s, m_i, l_i, t_i, qk_scale, SHIFT)
    return p, gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), m_i, l_i, t_i


@gluon.jit
def _ov_operand(p, dtype: gl.constexpr, HEAD_DIM: gl.constexpr):
    """P in bf16 in the P V MMA's register operand layout."""
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    return gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))  # ROUND


@gluon.jit
def _ov_consumer(WG: gl.constexpr, q_desc, q_smem, q_bar, k_ring, v_ring, kv_ready, kv_empty, turns, O, O32, LSE, b,
                 h, start_m, stop_unmasked, stop, stride_om, N, qk_scale, HEAD_DIM: gl.constexpr,
                 CAUSAL: gl.constexpr, SHIFT: gl.constexpr, KEEP_O32: gl.constexpr, STAGES: gl.constexpr):
    s_layout: gl.constexpr = mma_layout(4, BLOCK_N)
    o_layout: gl.constexpr = mma_layout(4, HEAD_DIM)
    dtype: gl.constexpr = q_desc.dtype
    rows0 = start_m + WG * 64
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, rows0, 0], q_bar, q_smem)
    mbarrier.wait(q_bar, 0)
    q2d = q_smem.reshape([64, HEAD_DIM])
    offs_m = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout))
    m_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    t_i = gl.full([64], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([64], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    n_tiles = gl.cdiv(stop, BLOCK_N)
    mine, theirs = turns.index(WG), turns.index(1 - WG)
    # turn 0: S of tile 0; acc is zero, its scaling by tile 0's alpha (kernels.py's) changes nothing but is kept
    mbarrier.wait(mine, 0)
    mbarrier.wait(kv_ready.index(0), 0)
    k_smem = k_ring.index(0).reshape([BLOCK_N, HEAD_DIM])
    s = warpgroup_mma(q2d, k_smem.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout), use_acc=False,
                      is_async=True)
    mbarrier.arrive(theirs, count=1)
    s, _ = warpgroup_mma_wait(0, deps=[s, k_smem])
    p, alpha, m_i, l_i, t_i = _ov_softmax(s, 0, stop_unmasked, offs_m, N, m_i, l_i, t_i, qk_scale, CAUSAL, SHIFT,
                                          HEAD_DIM)
    acc = acc * alpha[:, None]
    p = _ov_operand(p, dtype, HEAD_DIM)
    # turn it: S of tile it, P V of tile it - 1 (acc already scaled by tile it - 1's alpha)
    for it in range(1, n_tiles):
        slot, prev = it % STAGES, (it - 1) % STAGES
        mbarrier.wait(kv_ready.index(slot), (it // STAGES) & 1)
        mbarrier.wait(mine, it & 1)
        k_smem = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        v_smem = v_ring.index(prev).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q2d, k_smem.permute((1, 0)), gl.zeros([64, BLOCK_N], gl.float32, s_layout),
                          use_acc=False, is_async=True)
        acc = warpgroup_mma(p, v_smem, acc, is_async=True)
        mbarrier.arrive(theirs, count=1)
        # tile it - 2's slot, its P V MMA waited for in the last turn, back to the loader (released here, behind
        # the MMAs' issue, rather than right after that wait)
        cta_barrier()                            # the warpgroup's four warps are done with it
        mbarrier.arrive(kv_empty.index((it + STAGES - 2) % STAGES), count=1, pred=it >= 2)
        s, _ = warpgroup_mma_wait(1, deps=[s, k_smem])           # S done; P V may still run
        p32, alpha, m_i, l_i, t_i = _ov_softmax(s, it * BLOCK_N, stop_unmasked, offs_m, N, m_i, l_i, t_i, qk_scale,
                                                CAUSAL, SHIFT, HEAD_DIM)
        # P V done: only now are acc and P's registers (the MMA's operand) free to write
        acc, _ = warpgroup_mma_wait(0, deps=[acc, v_smem])
        acc = acc * alpha[:, None]
        p = _ov_operand(p32, dtype, HEAD_DIM)
    # the last turn: P V of the last tile
    mbarrier.wait(mine, n_tiles & 1)
    v_smem = v_ring.index((n_tiles - 1) % STAGES).reshape([BLOCK_N, HEAD_DIM])
    acc = warpgroup_mma(p, v_smem, acc, is_async=True)
    mbarrier.arrive(theirs, count=1)
    acc, _ = warpgroup_mma_wait(0, deps=[acc, v_smem])
    offs_m_o = rows0 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    _epilogue(acc, l_i, m_i, O, O32, LSE, offs_m_o, offs_m, stride_om, N, HEAD_DIM, o_layout, KEEP_O32)


# ---------------------------------------------------------------------------------------------------------
# Host side

def check(q, k, v, causal, fix, variant):
    """kernels.check_inputs' checks (fix's among them), then what this file adds; one clear error each."""
    check_inputs(q, k, v, causal, fix, Numerics())
    if q.shape[-1] not in (64, 128):
        raise ValueError(f"the Gluon forward takes head_dim 64 or 128, got {q.shape[-1]}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (head_dim); call .contiguous()")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(map(repr, VARIANTS))}, got {variant!r}")
    if variant != "sync":   # TMA reads 16-byte aligned rows
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.data_ptr() % 16 or any(stride * t.element_size() % 16 for stride in t.stride()[:-1]):
                raise ValueError(f'variant "tma" needs {name} 16-byte aligned with strides of multiples of 16 '
                                 f"bytes, got strides {t.stride()}; call .contiguous() or use variant \"sync\"")


def forward(q, k, v, *, fix, causal=True, variant="sync"):
    """kernels.forward's outputs for "fa2" numerics: (O, lse, the O delta reads: the fp32 O with fix "on", else O)."""
    check(q, k, v, causal, fix, variant)
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] != 9:
        raise ValueError(f"the Gluon forward runs on an sm_90 GPU (H100/H200), got {q.device}")
    return launch(q, k, v, causal, fix, variant)


def descriptor(t, rows):
    """A TMA descriptor of a (batch, heads, seq, head_dim) tensor in tiles of rows x head_dim (rows past seq read as
    zeros): any strides with head_dim contiguous and the others 16-byte aligned."""
    block = [1, 1, rows, t.shape[-1]]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if t.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def launch(q, k, v, causal, fix, variant):
    B, H, N, D = q.shape
    o = empty_in_layout_of(q)
    keep_o32 = fix == "on"                                    # THE FIX's store, as kernels.flash_fwd's KEEP_O32
    o32 = empty_in_layout_of(q, torch.float32) if keep_o32 else o    # (O32: never written without KEEP_O32)
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    block_m, warps = VARIANTS[variant]
    kernel = globals()[f"_fwd_{variant}"]
    out = (o, o32, lse)
    if variant != "sync":
        q_rows = block_m if variant == "tma" else 64      # "ws": each warpgroup reads its own 64 rows of Q
        args = [*(descriptor(t, rows) for t, rows in ((q, q_rows), (k, BLOCK_N.value), (v, BLOCK_N.value))), *out]
    else:
        args = [q, k, v, *out, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3]]
    kernel[(triton.cdiv(N, block_m), B * H)](
        *args, *o.stride()[:3], H, N, qk_scale_of(D, "fa2"), HEAD_DIM=D, BLOCK_M=block_m, CAUSAL=causal,
        SHIFT=fix_constants("fa2") if fix == "paper" else None, KEEP_O32=keep_o32, num_warps=warps, **UNFUSED)
    return o, lse, o32
