"""Flash attention in Triton, with the fix for the rounding bias that makes low-precision training fail.

    from kernels import flash_attention
    o = flash_attention(q, k, v, causal=True, fix="on")   # q, k, v: (batch, heads, seq, head_dim), bf16/fp16

Same result as torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), O and the gradients
seq-major where q is (a GPT's head views), else head-major; differentiable (not twice); head_dim 16/32/64/128; any
sequence length within 32-bit offsets (check_launch); a custom op (torch.compile traces it).

Notation (FlashAttention-2, Dao 2023), for a query tile Q_i and a key/value tile K_j, V_j:
    S = Q_i K_j^T * scale      m' = max(m, rowmax(S))      P = exp(S - m')
    l = exp(m - m') l + rowsum(P)      acc = exp(m - m') acc + P V_j      O = acc / l,  lse = m + log l
and in the backward, from the loss's gradient dO of O:
    delta = rowsum(dO * O)      dP = dO V^T      dS = P * (dP - delta)      dQ = dS K * scale

The paper (Qiu & Yao, arXiv 2510.04212): in bf16 the backward reads the forward's rounded O through delta with a
one-signed error, which piles up in W_Q / W_K until the loss explodes. THE FIX: delta reads the forward's fp32 O,
before its final cast. Each hop is marked "THE FIX", numbered in the order the data takes: flash_fwd turns fix "on"
into the kernel's KEEP_O32 (1), the forward's epilogue stores the fp32 O (2, _fwd_kernel), output_and_delta_o
chooses it (3), _FlashAttention hands it to the backward (4), _bwd_delta_kernel reads it (5); where no backward can
follow, flash_attention runs fix "off", the same O with no fp32 O stored. The O returned and every other number are
plain FlashAttention-2's, so the fix costs one fp32 store and its memory until the backward.
fix="on" is the fix (the default); fix="off" plain FlashAttention-2; fix="paper" the paper's own rule, which
blames rows with tied maxima (P exactly 1) and shifts their max up (its section before the forward): in our runs
it does not cure. Why, and the evidence: docs/kernel.md, "The fix".

Every rounding to the input dtype (or to fewer bits) is marked "ROUND", and so are the fp32 ones whose form is a
choice (S's scale, the exponent), in both precision modes ("fa2", as production kernels; "autocast", as the paper's
PyTorch code); nanolp/emulate.py computes the same bits, every fp32 operation in the kernel's order (docs/kernel.md,
"Two precision modes, ...").
Reading order, each piece before its first use (as in Triton's tutorial): S and P (the scores and the exponent of
the forward and of the backward's products); the paper's rule (the forward's inner loop calls it); forward;
backward; the experiments' switches (Numerics) and their roundings; host code, ending in the entry points forward
and flash_attention. This file imports nothing of the project: copied alone it runs. Speed: docs/kernel.md, "Speed".
"""
import functools
import math
import os
import struct
from collections import namedtuple
from dataclasses import dataclass, field, fields
from fractions import Fraction

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
TILE_N = 64                    # keys per tile (fixed: the paper's rule looks for ties within one tile)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


# ---------------------------------------------------------------------------------------------------------
# The notation's S and P in code, shared by the forward and both backward kernels: the backward must round S (and in
# "fa2" P) exactly as the forward did.

@triton.jit
def _scores(q, kT, qk_scale, AUTOCAST: tl.constexpr):
    """S as the exponent reads it: in "fa2" Q K^T itself, its scale applied inside the exponent (_exp2); in
    "autocast" scaled and rounded as the paper's PyTorch code does under bf16 autocast."""
    s = tl.dot(q, kT)                                            # fp32 accumulate of bf16 products
    if AUTOCAST:
        s = s.to(q.dtype).to(tl.float32)                         # ROUND: Q K^T in bf16 (autocast einsum)
        s = (s * qk_scale).to(q.dtype).to(tl.float32)            # ROUND: the scaled scores in bf16
    return s


@triton.jit
def _exp2(s, qk_scale, m, FMA: tl.constexpr):
    """P = 2^(s * qk_scale - m) in "fa2", for s = Q K^T (fp32: the notation's S before its scale) and m the scaled
    row max (or lse, in the backward).
    FMA: one fused multiply-add, as FA2 ships it; else rounded twice, as PyTorch builds FA2 (docs/kernel.md, "Two
    precision modes, ...")."""
    if FMA:
        x = tl.fma(s, qk_scale, -m)                              # ROUND: once
    else:
        x = s * qk_scale - m                                     # ROUND: s * qk_scale, ROUND: - m
    return tl.math.exp2(x)


# ---------------------------------------------------------------------------------------------------------
# The paper's rule (fix="paper"): a tied row's max shifted up, once per key tile (the forward's _fwd_inner, below,
# calls _shifted_max). Softmax is shift invariant, so it is exact in real arithmetic; no tied P is exactly 1 after
# it, so P V's rounding is no longer one-sided. It leaves O's final cast's error that delta reads, and does not cure
# our runs (docs/kernel.md, "The paper's rule"). Each piece of its code guards a sharp edge of the rule (underflow,
# r = 0, masked tiles, ties across tiles). Last, its host side: the constants in the kernel's units (fix_constants;
# p_bits is the amplifier's, Numerics below).

# The paper's shift, in nats (TIE_TOL: exp(-x) rounds to 1.0 in bf16 below ~2^-9).
TIE_TOL = 2.0 ** -9            # scores this close to a row's max tie with it
BETA = 2.0                     # the paper's factor: a tied max r > 0 moves to BETA * r (the official value)
SHIFT_LO, SHIFT_HI = 2.0 ** -6, 64.0   # the range the shift is folded into (_shifted_max)
# Its constants in the kernel's units, a compile-time constant (None with the shift off); inv: _fold's 1 / span.
Shift = namedtuple("Shift", "beta tol lo hi span inv")


@triton.jit
def _top2(a1, a2, b1, b2):
    """tl.reduce's combine for (largest, second largest) of a row, an equal value counted twice. The second's
    maxima propagate NaN (none occur), so -inf is their identity and the compiler drops a max per score."""
    ALL: tl.constexpr = tl.PropagateNan.ALL
    return tl.maximum(a1, b1), tl.maximum(tl.minimum(a1, b1), tl.maximum(a2, b2, ALL), ALL)


@triton.jit
def _fold(d, SHIFT: tl.constexpr):
    """lo + fmod(d, span) for 0 <= d <= |r| without a division (d % span has a slow path): floor(d * inv) in
    float64, inv = 1 / span rounded up. fmod's bits wherever they matter; the proof: docs/kernel.md, "The fold
    without a division"."""
    tl.static_assert(SHIFT.span >= 32.0)          # d >= 2^27 span only where |r| > 2^32
    tl.static_assert(SHIFT.hi < 2.0 ** 7 - 1.0)   # a fold below hi + 2^-49 |r| rounds away at |r| >= 2^32
    d64 = d.to(tl.float64)
    n = tl.floor(d64 * tl.full([], SHIFT.inv, tl.float64))
    rem = d64 - n * tl.full([], SHIFT.span, tl.float32).to(tl.float64)   # span as the float32 fmod reads
    return SHIFT.lo + rem.to(tl.float32)                                 # ROUND: lo + fmod(d, span)


@triton.jit
def _shifted_max(s, scale, t, SHIFT: tl.constexpr):
    """Row max to subtract from this tile's scores s * scale (r = rowmax(s) * scale, t = the raw row max of the
    earlier tiles); returns it and the new raw row max max(t, r). The paper's rule (Sec. 5): a row with two
    scores within tol of r (top-2: r2 >= r - tol), or here r within tol of t (a tie across tiles), moves its
    max up by d = (beta - 1) r or -r, folded into [lo, hi), so tied P are exp(-d) < 1, rounded both ways.
    Why each piece (underflow, r = 0, masked tiles, ties across tiles): docs/kernel.md, "The paper's rule"."""
    tl.static_assert(SHIFT.beta == 2.0)           # the paper's beta: d = |r| below (<= |r|, as _fold needs)
    tl.static_assert(SHIFT.lo > 0.0)              # d >= lo > 0: no tied P is exactly 1 after the shift
    r, r2 = tl.reduce((s, tl.full(s.shape, float("-inf"), tl.float32)), 1, _top2)
    r, r2 = r * scale, r2 * scale                                                      # ROUND: as S's scale
    across = (r >= t - SHIFT.tol) & (t >= r - SHIFT.tol)
    tied = ((r2 >= r - SHIFT.tol) | across) & (r > float("-inf"))
    # (beta - 1) r = r for r > 0 and -r below: |r|, free (an operand modifier); r = +-0 folds to lo either way
    d = tl.abs(r)
    d = tl.where((d >= SHIFT.lo) & (d < SHIFT.hi), d, _fold(d, SHIFT))
    return tl.where(tied, r + d, r), tl.maximum(t, r)                                  # ROUND: r + d


def widening(bits):
    """How much wider than bf16's the band of scores whose P rounds to 1.0 is, P at `bits` bits (0: bf16)."""
    return 2.0 ** (7 - bits) if bits else 1.0


def reciprocal_up(span):
    """The float64 nearest to 1 / span from above, for span as the kernel holds it (rounded to float32): _fold's
    quotient d * inv is then never below d / span."""
    span = struct.unpack("f", struct.pack("f", span))[0]
    inv = 1.0 / span
    return inv if Fraction(inv) * Fraction(span) >= 1 else math.nextafter(inv, math.inf)


@functools.cache   # (each call of the forward asks; the answer never changes)
def fix_constants(precision, p_bits=0):
    """The shift's constants in the kernel's units (log2 units in "fa2"), in float64; tol and lo widen with
    the amplifier's p_bits (widening), as the band of scores whose P rounds to 1.0 does."""
    unit = LOG2E if precision == "fa2" else 1.0
    lo = SHIFT_LO * widening(p_bits)
    span = (SHIFT_HI - lo) * unit
    return Shift(BETA, TIE_TOL * widening(p_bits) * unit, lo * unit, SHIFT_HI * unit, span, reciprocal_up(span))


# ---------------------------------------------------------------------------------------------------------
# Forward: the amplifier's rounding (an experiment's, compiled away without it), the loop over key tiles, the
# kernel.

@triton.jit
def _round_bits(x, BITS: tl.constexpr):
    """The amplifier (Numerics.mantissa_bits): fp32 x rounded to BITS mantissa bits, ties to even (P before
    P V, as FP8 attention does, or O before its store with amplify="vo"). BITS = 0: no-op."""
    if BITS > 0:
        tl.static_assert(BITS < 23)                          # fp32 has 23: at least one bit is dropped
        DROP: tl.constexpr = 23 - BITS
        b = x.to(tl.int32, bitcast=True)
        b = (b + ((1 << (DROP - 1)) - 1) + ((b >> DROP) & 1)) & ~((1 << DROP) - 1)
        x = b.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _fwd_inner(acc, l_i, m_i, t_i, q, K, V, stride_kn, stride_vn, start, stop, offs_m, offs_n, offs_d, N,
               qk_scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr,
               SHIFT: tl.constexpr, P_BITS: tl.constexpr, FMA: tl.constexpr, BLOCK_N: tl.constexpr):
    """Run the FA2 recurrence over key tiles [start, stop). MASKED tiles are the ragged last tile and, when
    causal, the tiles on the diagonal; all others need no mask, which keeps the main loop lean."""
    for start_n in range(start, stop, BLOCK_N):
        cols = start_n + offs_n
        kT_ptrs = K + offs_d[:, None] + cols[None, :] * stride_kn
        v_ptrs = V + cols[:, None] * stride_vn + offs_d[None, :]
        if MASKED:
            kT = tl.load(kT_ptrs, mask=cols[None, :] < N, other=0.0)
            v = tl.load(v_ptrs, mask=cols[:, None] < N, other=0.0)
        else:
            kT = tl.load(kT_ptrs)
            v = tl.load(v_ptrs)
        # S = Q_i K_j^T * scale: in "fa2" s is Q_i K_j^T and the scale is applied per row to its max here and per
        # score inside the exponent (_exp2); rounding is monotone, so rowmax(s) * scale is rowmax(S) exactly
        s = _scores(q, kT, qk_scale, AUTOCAST)
        if not AUTOCAST:
            scale = qk_scale
        else:
            scale = 1.0
        if MASKED:
            valid = cols[None, :] < N
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            s = tl.where(valid, s, float("-inf"))
        # m' = max(m, rowmax(S))   (the shift changes only rowmax(S) here; t_i: the unshifted running max)
        if SHIFT is None:
            r = tl.max(s, 1) * scale                                                  # ROUND: as S's scale
        else:
            r, t_i = _shifted_max(s, scale, t_i, SHIFT)      # the paper's rule: a tied max shifted up
        if not AUTOCAST:
            m_new = tl.maximum(m_i, r)
            alpha = tl.math.exp2(m_i - m_new)
            p = _exp2(s, qk_scale, m_new[:, None], FMA)
            # l = exp(m - m') l + rowsum(P), from the unrounded P
            l_i = l_i * alpha + tl.sum(p, 1)
            # acc = exp(m - m') acc + P V_j
            acc = acc * alpha[:, None]
            acc = tl.dot(_round_bits(p, P_BITS).to(q.dtype), v, acc)                  # ROUND: P to bf16
        else:
            m_new = tl.maximum(m_i, r).to(q.dtype).to(tl.float32)                     # ROUND: m in bf16
            alpha = tl.exp((m_i - m_new).to(q.dtype).to(tl.float32))                  # ROUND: m - m'
            alpha = alpha.to(q.dtype).to(tl.float32)                                  # ROUND: exp(m - m')
            p = tl.exp((s - m_new[:, None]).to(q.dtype).to(tl.float32))               # ROUND: S - m'
            p = _round_bits(p, P_BITS).to(q.dtype)                                    # ROUND: P
            # l = exp(m - m') l + rowsum(P)
            l_i = (alpha * l_i).to(q.dtype).to(tl.float32)                            # ROUND
            l_i = (l_i + tl.sum(p.to(tl.float32), 1).to(q.dtype).to(tl.float32))     # ROUND: rowsum(P)
            l_i = l_i.to(q.dtype).to(tl.float32)                                      # ROUND: l in bf16
            # acc = exp(m - m') acc + P V_j
            pv = tl.dot(p, v).to(q.dtype).to(tl.float32)                              # ROUND: P V in bf16
            acc = (acc * alpha[:, None]).to(q.dtype).to(tl.float32)                   # ROUND
            acc = (acc + pv).to(q.dtype).to(tl.float32)                               # ROUND: acc in bf16
        m_i = m_new
    return acc, l_i, m_i, t_i


@triton.jit
def _fwd_kernel(Q, K, V, O, O32, LSE,
                stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N, qk_scale,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                AUTOCAST: tl.constexpr, SHIFT: tl.constexpr, P_BITS: tl.constexpr, O_BITS: tl.constexpr,
                FMA: tl.constexpr, KEEP_O32: tl.constexpr):
    # One program per (query tile, batch * head). O32 (KEEP_O32 only, which flash_fwd sets, else None): the fp32 O
    # that THE FIX's delta reads, or that the stochastic-rounding experiments round (below).
    # SHIFT: the paper's rule's constants (fix_constants; None without it). P_BITS, O_BITS: _round_bits; FMA: _exp2.
    tl.static_assert(BLOCK_M % BLOCK_N == 0)      # so a query tile's diagonal starts on a key tile (below)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    O += b * stride_ob + h * stride_oh
    LSE += bh * N
    # Query tiles heaviest first, so light ones fill the GPU's tail; no bit changes (docs/kernel.md, "The kernel's
    # structure")
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + offs_m[:, None] * stride_qm + offs_d[None, :], mask=offs_m[:, None] < N, other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    t_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Key tiles that need no mask: all full tiles (non-causal) or those left of the diagonal (causal).
    if CAUSAL:
        stop_unmasked = start_m
        stop = tl.minimum(start_m + BLOCK_M, N)
    else:
        stop_unmasked = (N // BLOCK_N) * BLOCK_N
        stop = N
    acc, l_i, m_i, t_i = _fwd_inner(acc, l_i, m_i, t_i, q, K, V, stride_kn, stride_vn, 0, stop_unmasked,
                                    offs_m, offs_n, offs_d, N, qk_scale,
                                    False, CAUSAL, AUTOCAST, SHIFT, P_BITS, FMA, BLOCK_N)
    acc, l_i, m_i, t_i = _fwd_inner(acc, l_i, m_i, t_i, q, K, V, stride_kn, stride_vn, stop_unmasked, stop,
                                    offs_m, offs_n, offs_d, N, qk_scale,
                                    True, CAUSAL, AUTOCAST, SHIFT, P_BITS, FMA, BLOCK_N)
    # O = acc / l, stored in the input dtype (to O_BITS bits first with amplify="vo"); lse = m + log l in fp32
    o = _round_bits(acc / l_i[:, None], O_BITS)                      # ROUND: to O_BITS bits (amplify="vo")
    tl.store(O + offs_m[:, None] * stride_om + offs_d[None, :], o.to(O.dtype.element_ty),    # ROUND: O
             mask=offs_m[:, None] < N)
    if KEEP_O32:
        # THE FIX (2, the store): the fp32 o the cast above rounded, stored beside O for the backward's delta
        # (output_and_delta_o; the stochastic-rounding experiments round it there). O32 is laid out as O: O's
        # strides serve it.
        O32 += b * stride_ob + h * stride_oh
        tl.store(O32 + offs_m[:, None] * stride_om + offs_d[None, :], o, mask=offs_m[:, None] < N)
    lse = m_i + (tl.log(l_i) if AUTOCAST else tl.math.log2(l_i))
    tl.store(LSE + offs_m, lse, mask=offs_m < N)


# ---------------------------------------------------------------------------------------------------------
# Backward, FA2 style: delta first, then two passes, dK/dV (one program per key tile, looping over queries) and dQ
# (one program per query tile, looping over keys), so nothing needs atomics. P is recomputed from lse.
#     delta = rowsum(dO * O)      P = exp(S - lse)      dV += P^T dO      dP = dO V^T
#     dS = P * (dP - delta)       dQ += dS K * scale    dK += dS^T Q * scale
# 7 matrix products per tile pair. The paper's control, delta from P: docs/kernel.md, "Experiment options".

@triton.jit
def _bwd_delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om, H, N, HEAD_DIM: tl.constexpr,
                      BLOCK_M: tl.constexpr):
    # delta = rowsum(dO * O), from the O _FlashAttention saved (output_and_delta_o): this is where the bias in O
    # enters the gradient. THE FIX (5, the read): with fix "on" this O is the forward's fp32 O (hops 1, 3 and 4 are
    # in the host code below).
    bh = tl.program_id(1).to(tl.int64)
    O += (bh // H) * stride_ob + (bh % H) * stride_oh
    DO += (bh // H) * stride_ob + (bh % H) * stride_oh        # dO is in O's layout
    DELTA += bh * N
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = rows[:, None] * stride_om + tl.arange(0, HEAD_DIM)[None, :]
    o = tl.load(O + offs, mask=rows[:, None] < N, other=0.0)
    do = tl.load(DO + offs, mask=rows[:, None] < N, other=0.0)
    tl.store(DELTA + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1), mask=rows < N)


@triton.jit
def _bwd_probs(a, bT, lse, queries, keys, N, qk_scale, CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr,
               FMA: tl.constexpr):
    """P = exp(S - lse) for a (query tile, key tile) pair, its exponent rounded exactly as in the forward in "fa2"
    (in "autocast" exp in fp32, where the forward rounded S - m' first), in either orientation: a bT = Q_i K_j^T
    gives P, a bT = K_j Q_i^T gives P^T (the dK/dV kernel's); lse and the query and key indices come broadcast to
    that orientation ([:, None] for rows, [None, :] for columns)."""
    s = _scores(a, bT, qk_scale, AUTOCAST)
    valid = (queries < N) & (keys < N)
    if CAUSAL:
        valid = valid & (queries >= keys)
    s = tl.where(valid, s, float("-inf"))
    if not AUTOCAST:
        return _exp2(s, qk_scale, lse, FMA)
    return tl.exp(s - lse)


@triton.jit
def _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, rows, cols, offs_d, stride_qm, stride_om, N, qk_scale,
                   CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr):
    """One query tile's share of a key tile's dK and dV; returns them and dS^T (in the input dtype), which the
    one-pass backward of experiments/launch_variants.py reuses for dQ (the two-pass kernel below drops it)."""
    qT = tl.load(Q + offs_d[:, None] + rows[None, :] * stride_qm, mask=rows[None, :] < N, other=0.0)
    doT = tl.load(DO + offs_d[:, None] + rows[None, :] * stride_om, mask=rows[None, :] < N, other=0.0)
    lse = tl.load(LSE + rows, mask=rows < N, other=0.0)
    delta = tl.load(DELTA + rows, mask=rows < N, other=0.0)
    # P^T = exp(S^T - lse), S^T = K_j Q_i^T * scale
    pT = _bwd_probs(k, qT, lse[None, :], rows[None, :], cols[:, None], N, qk_scale, CAUSAL, AUTOCAST, FMA)
    # dV += P^T dO
    dv += tl.dot(pT.to(k.dtype), tl.trans(doT))              # ROUND: P to bf16
    # dP^T = V_j dO_i^T      dS^T = P^T * (dP^T - delta)
    dpT = tl.dot(v, doT)
    dsT = (pT * (dpT - delta[None, :])).to(k.dtype)          # ROUND: dS to bf16
    # dK += dS^T Q (times the scale once, at the store)
    dk += tl.dot(dsT, tl.trans(qT))
    return dk, dv, dsT


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV,
                     stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                     stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N,
                     qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr):
    # One program per (key tile, batch * head), looping over query tiles. Key-major: P^T and dS^T feed dV and dK
    # from registers, untransposed (docs/kernel.md, "The kernel's structure").
    tl.static_assert(BLOCK_N % BLOCK_M == 0)      # so a key tile's diagonal starts on a query tile (below)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_ob + h * stride_oh           # dO, dK and dV are in O's layout
    DK += b * stride_ob + h * stride_oh
    DV += b * stride_ob + h * stride_oh
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
        dk, dv, _ = _bwd_dkdv_tile(dk, dv, k, v, Q, DO, LSE, DELTA, rows, cols, offs_d, stride_qm, stride_om, N,
                                   qk_scale, CAUSAL, AUTOCAST, FMA)
    out = cols[:, None] * stride_om + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols[:, None] < N)     # ROUND: dK
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols[:, None] < N)                  # ROUND: dV


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ,
                   stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                   stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N, qk_scale, sm_scale,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   CAUSAL: tl.constexpr, AUTOCAST: tl.constexpr, FMA: tl.constexpr, DELTA_FROM_P: tl.constexpr):
    # One program per (query tile, batch * head), looping over the keys. DELTA_FROM_P: the paper's control
    # instead, delta = rowsum(dP * P) (over rowsum(P) in "autocast"), stored; run before dK/dV and dQ.
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_ob + h * stride_oh           # dO and dQ are in O's layout
    DQ += b * stride_ob + h * stride_oh
    LSE += bh * N
    DELTA += bh * N
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M     # heaviest first, as in the forward
    rows = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(Q + rows[:, None] * stride_qm + offs_d[None, :], mask=rows[:, None] < N, other=0.0)
    do = tl.load(DO + rows[:, None] * stride_om + offs_d[None, :], mask=rows[:, None] < N, other=0.0)
    lse = tl.load(LSE + rows, mask=rows < N, other=0.0)
    if DELTA_FROM_P:
        delta = tl.zeros([BLOCK_M], tl.float32)
        p_sum = tl.zeros([BLOCK_M], tl.float32)
    else:
        delta = tl.load(DELTA + rows, mask=rows < N, other=0.0)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    stop = tl.minimum(start_m + BLOCK_M, N) if CAUSAL else N
    for start_n in range(0, stop, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        kT = tl.load(K + offs_d[:, None] + cols[None, :] * stride_kn, mask=cols[None, :] < N, other=0.0)
        vT = tl.load(V + offs_d[:, None] + cols[None, :] * stride_vn, mask=cols[None, :] < N, other=0.0)
        p = _bwd_probs(q, kT, lse[:, None], rows[:, None], cols[None, :], N, qk_scale, CAUSAL, AUTOCAST, FMA)
        dp = tl.dot(do, vT)
        if DELTA_FROM_P:
            delta += tl.sum(p * dp, 1)
            p_sum += tl.sum(p, 1)
        else:
            ds = p * (dp - delta[:, None])
            dq += tl.dot(ds.to(q.dtype), tl.trans(kT))           # ROUND: dS to bf16
    if DELTA_FROM_P:
        if AUTOCAST:                # (rows past N, never stored, have no keys: p_sum = 0)
            delta = delta / tl.where(rows < N, p_sum, 1.0)
        tl.store(DELTA + rows, delta, mask=rows < N)
    else:
        tl.store(DQ + rows[:, None] * stride_om + offs_d[None, :], (dq * sm_scale).to(DQ.dtype.element_ty),
                 mask=rows[:, None] < N)                                                    # ROUND: dQ


# ---------------------------------------------------------------------------------------------------------
# The experiments' switches (flash_attention's numerics=): how the kernel rounds, for studying the failure, and
# the roundings they need on the host (in the kernels: _round_bits). The defaults are plain FlashAttention-2;
# training a model needs none of this.

def option(help, default, choices=None):
    """A field of Numerics: what it does (also its train.py flag's help), its default, the values it takes."""
    return field(default=default, metadata=dict(help=help, choices=choices))


@dataclass(frozen=True)
class Numerics:
    """How the attention rounds, for studying the failure; the defaults are plain FlashAttention-2. Each field
    is also a train.py flag, a config.json/summary.json key and a runs.csv column of the project's runs."""
    precision: str = option("fa2: S, m, l and acc in fp32 (production kernels); autocast: the rounding points of "
                            "the paper's PyTorch code under bf16 autocast", "fa2", ("fa2", "autocast"))
    delta: str = option("what the backward's delta reads (fp32-o with fix on): o, the O returned (the paper's "
                        "channel); fp32-o, the forward's fp32 O, before its final cast (what fix on reads: with fix "
                        "paper, the paper's rule and the fix together); p, rowsum(dP * P) from P recomputed in fp32 "
                        "(the paper's control); stochastic-o, an independent stochastic rounding of the fp32 O", "o",
                        ("o", "fp32-o", "p", "stochastic-o"))
    stochastic_o: str = option("forward: O stochastically rounded in the forward, the O that the next layer reads "
                               "(and delta, with delta o and fix off or paper)", "off", ("off", "forward"))
    mantissa_bits: int = option("the amplifier: P (or V and O) rounded to 1-6 mantissa bits (3: FP8); 0: off",
                                0, range(7))
    amplify: str = option("what mantissa_bits rounds: P before P V, or V and O (amplifies the tie bias)",
                          "p", ("p", "vo"))
    exponent: str = option("softmax's exponent Q K^T * scale - m: fma, one fused multiply-add (FlashAttention-2 "
                           "as its authors ship it); torch, Q K^T * scale rounded first (PyTorch's build of FA2)",
                           "fma", ("fma", "torch"))

    def __post_init__(self):
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if type(value) is not f.type:
                raise ValueError(f"{f.name} must be a {f.type.__name__}, got {value!r}")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        if self.amplify != "p" and self.mantissa_bits == 0:
            raise ValueError(f"amplify={self.amplify!r} says what mantissa_bits rounds: "
                             "give mantissa_bits 1-6")
        if self.exponent != "fma" and self.precision == "autocast":
            raise ValueError('exponent="torch" is a form of the "fa2" exponent; precision="autocast" rounds S on its '
                             "own (in natural units): choose one")
        if self.stochastic_o == "forward" and self.delta == "stochastic-o":
            raise ValueError('stochastic_o="forward" and delta="stochastic-o" are different stochastic roundings of '
                             "the O that delta reads: choose one")

    @property
    def draws(self):
        """Whether O is rounded stochastically somewhere (torch's generator draws: stochastic_round)."""
        return self.stochastic_o != "off" or self.delta == "stochastic-o"

    @property
    def fma(self):
        """Whether the exponent is one fused multiply-add (kernels._exp2)."""
        return self.exponent == "fma"

    @property
    def p_bits(self):
        """The amplifier on P: mantissa bits P is rounded to before P V (0: the input dtype's)."""
        return self.mantissa_bits if self.amplify == "p" else 0

    @property
    def o_bits(self):
        """The amplifier on V and O: mantissa bits V is rounded to before attention reads it, and O before its
        final cast (0: none)."""
        return self.mantissa_bits if self.amplify == "vo" else 0


def stochastic_round(x, generator=None):
    """Round fp32 x to bfloat16 stochastically, unbiased (E[result] = x): 16 random bits added below bf16's
    mantissa, then truncated. For the stochastic-rounding experiments only."""
    if x.dtype != torch.float32:   # (its bits are read as int32)
        raise TypeError(f"stochastic_round rounds float32 to bfloat16, got {x.dtype}")
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -(1 << 16)    # sign-magnitude: |x| rounded up or down, to bf16
    rounded = torch.where(torch.isfinite(x), bits.view(torch.float32), x)
    return torch.empty_like(x, dtype=torch.bfloat16).copy_(rounded)    # in x's layout


def round_mantissa(x, bits):
    """Round values to `bits` explicit mantissa bits (ties to even) on their float32 bit pattern, keeping
    float32's exponent range; returned as float32. bits=7 is bfloat16, 3 the mantissa of FP8 e4m3."""
    if not (isinstance(bits, int) and 0 <= bits <= 23):
        raise ValueError(f"bits must be float32's explicit mantissa bits kept, an integer 0-23, got {bits!r}")
    drop = 23 - bits
    if drop == 0:
        return x.float()
    b = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    half = (1 << (drop - 1)) - 1
    b = (b + half + ((b >> drop) & 1)) >> drop << drop
    out = (b & 0xFFFFFFFF).to(torch.int64)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float())


def amplified_v(v, bits):
    """amplify="vo" (bits: Numerics.o_bits): V rounded to bits before attention sees it, so the forward and
    the backward read the same V; its gradient passes straight through to the unrounded V."""
    if not bits:
        return v
    return round_mantissa(v, bits).to(v.dtype).detach() + (v - v.detach())      # ROUND: V to bits


# ---------------------------------------------------------------------------------------------------------
# Host side: the checks, THE FIX's choice of the O that delta reads, the custom ops and their launches, the
# autograd Function, and last the entry points, forward (every output, for tests and experiments) and
# flash_attention.

# Tuning per head_dim, fixed (no autotune: the summation order never depends on a timing). Forward: (BLOCK_M,
# warps, stages); backward: (BLOCK_M, BLOCK_N, warps, stages), unpipelined up to SHORT_SEQ keys (the timings behind
# them: results/speed/README.md, "kernels.py's settings").
FWD_TUNING = {16: (128, 4, 3), 32: (128, 4, 3), 64: (128, 8, 3), 128: (128, 8, 4)}
BWD_TUNING = {16: (64, 64, 4, 2), 32: (64, 64, 4, 2), 64: (64, 64, 4, 3), 128: (64, 64, 4, 2)}
SHORT_SEQ = 512
# GPUs whose blocks may have 99 KB of shared memory (compute capability 8.6 and 8.9: RTX 30xx and 40xx, A10, L4,
# L40) where head_dim 128's forward would take 128 KB in 4 stages: there it takes 3 (96 KB). Stages only pipeline
# the loads, so the bits are the same (python -m nanolp.compile_sm90 --arch 86 checks every launch's fit).
SMALL_SHARED = ((8, 6), (8, 9))
FWD_TUNING_SMALL_SHARED = {**FWD_TUNING, 128: (128, 8, 3)}
# No floating-point contraction: each operation rounds where the ROUND marks say, and the only fma is _exp2's
# tl.fma (left to itself, ptxas fuses the exponent's multiply and subtraction in some tiles and not in others:
# docs/kernel.md, "Correctness evidence").
UNFUSED = dict(enable_fp_fusion=False)
if INTERPRET:
    FWD_TUNING = FWD_TUNING_SMALL_SHARED = {D: (64, 4, 1) for D in FWD_TUNING}


def capability(device):
    """A CUDA device's compute capability, (major, minor); elsewhere (the interpreter) an H100's."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (9, 0)


FIXES = ("off", "on", "paper")   # fix's values, as flash_attention and train.py's --fix take them


def check_fix(fix, numerics):
    """fix's one check where it enters: flash_attention's (through forward's check_inputs) and train.py's
    (nanolp/runconfig.py, which says it in flags); with fix "on" delta reads the fp32 O, so numerics may ask for no
    other."""
    if fix not in FIXES:
        raise ValueError(f'fix must be "off", "on" or "paper", got {fix!r}')
    if fix == "on" and numerics.delta not in ("o", "fp32-o"):
        raise ValueError(f'fix="on" (delta from the fp32 O) and delta="{numerics.delta}" are different ways of '
                         "computing delta: choose one")


def check_device(q):
    """The kernel runs compiled, on CUDA tensors, or under Triton's CPU interpreter once nanolp/interp_patch.py
    has patched it: the stock interpreter computes bf16 wrongly, finite and silent."""
    if INTERPRET:
        from triton.runtime import interpreter
        if q.device.type not in ("cpu", "cuda"):   # (it copies each tensor's data to the host)
            problem = f"Triton's CPU interpreter reads the tensors' data, which {q.device} tensors do not hold"
        elif getattr(interpreter, "nanolp_bf16_patch", False):
            return
        else:
            problem = "Triton's CPU interpreter computes bf16 wrongly unless nanolp/interp_patch.py patches it"
    elif q.device.type == "cuda":
        return
    else:
        problem = f"the kernel needs CUDA tensors, got {q.device}"
    raise ValueError(f"{problem}; on the CPU use torch's scaled_dot_product_attention, or in nanolp "
                     "nanolp.emulate.emulate_attention, the kernel's algorithm in PyTorch (the same numbers)")


def seq_major(t):
    """Whether a (batch, heads, seq, head_dim) tensor's heads lie closer in memory than its rows."""
    return t.stride(1) < t.stride(2)


def check_launch(q, k, v):
    """What the kernel cannot take and its emulation can: bfloat16 where Triton cannot compile it, more programs
    than CUDA's grid has in batch * heads, and offsets within a head past the kernel's 32 bits (its row offsets are
    int32; a head's start is int64)."""
    B, H, N, D = q.shape
    if q.dtype == torch.bfloat16 and capability(q.device) < (8, 0):   # (a T4, a V100: Triton cannot compile it)
        raise TypeError(f"bfloat16 needs a GPU of compute capability 8.0 or later (an A100, RTX 30xx, L4, H100); "
                        f"{q.device} has {'.'.join(map(str, capability(q.device)))}")
    if B * H > 65_535:   # (the grid's second dimension)
        raise ValueError(f"batch * heads must be at most 65,535, the kernel's grid, got {B} * {H} = {B * H}")
    o_rows = H * D if seq_major(q) else D   # O's row stride (empty_in_layout_of), as dO's, dQ's ...
    for name, rows in (("q", q.stride(2)), ("k", k.stride(2)), ("v", v.stride(2)), ("O", o_rows)):
        if (N - 1) * rows + D > 2 ** 31:
            raise ValueError(f"{name}'s {N:,} rows, {rows:,} elements apart, reach past 2^31 elements within a head, "
                             "where the kernel's 32-bit offsets would wrap: give shorter sequences")


def check_inputs(q, k, v, causal, fix, numerics):
    """Clear errors instead of wrong answers (shared with nanolp/emulate.py); Numerics checks itself."""
    if not isinstance(causal, bool):   # (a truthy string would run causal attention silently)
        shown = f"a tensor of shape {tuple(causal.shape)}" if isinstance(causal, torch.Tensor) else repr(causal)
        raise ValueError(f"causal must be True or False (there is no mask argument), got {shown}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout != torch.strided:
            raise TypeError(f"{name} must be a dense (strided) tensor, got {t.layout}")
        if t.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be bfloat16 or float16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq, head_dim), got {tuple(t.shape)}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] not in (16, 32, 64, 128):
        raise ValueError(f"head_dim must be 16, 32, 64 or 128, got {q.shape[-1]}")
    if q.shape[-2] < 1 or q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"batch, heads and seq must be at least 1, got {tuple(q.shape)}")
    if fix == "paper" and q.dtype != torch.bfloat16:   # (float16's exponent stops at 2^-24)
        raise TypeError(f'fix="paper" shifts a tied row\'s max up by as much as {SHIFT_HI:.0f} nats, where P '
                        f"underflows {q.dtype}: give bfloat16 inputs")
    if numerics.draws and q.dtype != torch.bfloat16:
        raise TypeError(f'stochastic_o and delta="stochastic-o" round O to bfloat16; q, k, v are {q.dtype}')
    check_fix(fix, numerics)


PLAIN = Numerics()   # made once: torch.compile(fullgraph=True) cannot trace Numerics() inside a compiled function


def as_numerics(numerics):
    """The entry points' numerics: None is plain FlashAttention-2's, PLAIN; what is not a Numerics, refused."""
    if numerics is None:
        return PLAIN
    if not isinstance(numerics, Numerics):
        raise TypeError(f"numerics must be a kernels.Numerics or None, got {type(numerics).__name__}")
    return numerics


def empty_in_layout_of(t, dtype=None):
    """An uninitialised (batch, heads, seq, head_dim) tensor, seq-major where t is (a head view of a (batch, seq,
    channels) tensor, so model.py's reshape back is free), else head-major; dtype: t's by default."""
    B, H, N, D = t.shape
    dtype = dtype or t.dtype
    if seq_major(t):
        return torch.empty((B, N, H, D), dtype=dtype, device=t.device).transpose(1, 2)
    return torch.empty((B, H, N, D), dtype=dtype, device=t.device)


def qk_scale_of(head_dim, precision):
    """The kernels' qk_scale, Q K^T's scale inside the exponent: 1 / sqrt(head_dim), times log2 e in "fa2" (exp2)."""
    return head_dim ** -0.5 * (LOG2E if precision == "fa2" else 1.0)


def delta_reads(fix, delta_from):
    """Which O the backward's delta reads, as Numerics.delta names it: with fix "on" the fp32 O (THE FIX), else
    delta_from's ("p" reads none: the O returned is passed on and not read)."""
    return "fp32-o" if fix == "on" else delta_from


def output_and_delta_o(o, o32, fix, stochastic, delta_from):
    """From the kernel's O and its fp32 O (o32, where kept), the O the caller gets and the O delta reads (o
    itself where it reads that). THE FIX (3, the choice): with fix "on" (or delta_from "fp32-o") delta reads
    o32; the caller's O is the same bits either way (docs/kernel.md, "The fix"). The other cases are the
    stochastic-rounding experiments' (Numerics)."""
    if stochastic:
        o = stochastic_round(o32)                                                     # ROUND: O, stochastically
    reads = delta_reads(fix, delta_from)
    if reads == "fp32-o":
        return o, o32
    return o, stochastic_round(o32) if reads == "stochastic-o" else o     # ROUND: delta's O, an independent draw


# The custom ops take plain values (a schema has no dataclass): fix itself, Numerics' parts (delta_from:
# Numerics.delta). They check nothing: the entry points below do. Tools that record their launches on CPU
# tensors call them directly (nanolp/compile_sm90.py, experiments/sass.py).
def flash_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, fix: str, delta_from: str,
              precision: str, p_bits: int, o_bits: int, stochastic: bool, fma: bool) -> list[torch.Tensor]:
    """Returns O (q's dtype) and lse, then, where delta reads another O than the one returned, that O (a
    schema's way of an output that only some calls have). delta_from "p" is for the backward only
    (_FlashAttention)."""
    B, H, N, D = q.shape
    o = empty_in_layout_of(q)
    # THE FIX (1, the flag): with fix "on" the kernel keeps the fp32 O (KEEP_O32); so it does wherever else
    # output_and_delta_o reads it (the experiments' delta "fp32-o" and "stochastic-o", and stochastic_o)
    keep_o32 = stochastic or delta_reads(fix, delta_from) in ("fp32-o", "stochastic-o")
    o32 = empty_in_layout_of(q, torch.float32) if keep_o32 else None
    assert o32 is None or o32.stride() == o.stride()     # the kernel stores both with O's strides
    lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)
    block_m, warps, stages = (FWD_TUNING_SMALL_SHARED if capability(q.device) in SMALL_SHARED else FWD_TUNING)[D]
    _fwd_kernel[(triton.cdiv(N, block_m), B * H)](
        q, k, v, o, o32, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3],
        H, N, qk_scale_of(D, precision), HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=TILE_N, CAUSAL=causal,
        AUTOCAST=precision == "autocast", SHIFT=fix_constants(precision, p_bits) if fix == "paper" else None,
        P_BITS=p_bits, O_BITS=o_bits, FMA=fma, KEEP_O32=keep_o32, num_warps=warps, num_stages=stages,
        **UNFUSED)
    o, o_delta = output_and_delta_o(o, o32, fix, stochastic, delta_from)
    return [o, lse] if o_delta is o else [o, lse, o_delta]


flash_fwd_op = torch.library.custom_op("nanolp::flash_fwd", flash_fwd, mutates_args=())


@flash_fwd_op.register_fake
def _(q, k, v, causal, fix, delta_from, precision, p_bits, o_bits, stochastic, fma):
    o, lse = empty_in_layout_of(q), q.new_empty(q.shape[:3], dtype=torch.float32)
    reads = delta_reads(fix, delta_from)
    if reads in ("fp32-o", "stochastic-o"):
        return [o, lse, empty_in_layout_of(q, torch.float32 if reads == "fp32-o" else None)]
    return [o, lse]


def bwd_launch(q, k, v, o, causal, precision, fma):
    """What every backward kernel is launched with: the grids per query tile and per key tile, the strides (O's
    for dO, dQ, dK, dV too) and qk_scale, the meta-parameters (BWD_TUNING's)."""
    B, H, N, D = q.shape
    block_m, block_n, warps, stages = BWD_TUNING[D]
    if N <= SHORT_SEQ:
        stages = 1
    grids = tuple((triton.cdiv(N, block), B * H) for block in (block_m, block_n))
    strides = (*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], H, N,
               qk_scale_of(D, precision))
    meta = dict(HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, AUTOCAST=precision == "autocast",
                FMA=fma, num_warps=warps, num_stages=stages, **UNFUSED)
    return grids, strides, meta


def bwd_delta(do, q, k, v, o, lse, causal, precision, from_p, fma):
    """delta = rowsum(dO * O), or with from_p the paper's control (no O read). do must be in O's layout."""
    (per_query, _), strides, meta = bwd_launch(q, k, v, o, causal, precision, fma)
    delta = torch.empty_like(lse)
    if from_p:
        # the dQ pass in its delta mode: DQ and sm_scale unused (delta stands in for DQ)
        _bwd_dq_kernel[per_query](q, k, v, do, lse, delta, delta, *strides, 1.0, DELTA_FROM_P=True, **meta)
    else:
        _bwd_delta_kernel[per_query](o, do, delta, *o.stride()[:3], *q.shape[1:3], HEAD_DIM=meta["HEAD_DIM"],
                                     BLOCK_M=meta["BLOCK_M"], **UNFUSED)
    return delta


def dense_do(do, q, o):
    """dO as the kernels read it: with O's strides and q's dtype (exact: an fp32 dO from the cast holds bf16)."""
    if do.stride() != o.stride() or do.dtype != q.dtype:
        do = torch.empty_like(o, dtype=q.dtype).copy_(do)
    return do


def flash_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, causal: bool, precision: str, from_p: bool,
              fma: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV, from o the O that delta reads: dK/dV and dQ in two passes, no atomics."""
    do = dense_do(do, q, o)
    (per_query, per_key), strides, meta = bwd_launch(q, k, v, o, causal, precision, fma)
    args = (q, k, v, do, lse, bwd_delta(do, q, k, v, o, lse, causal, precision, from_p, fma))
    dq, dk, dv = (torch.empty_like(o, dtype=q.dtype) for _ in range(3))   # o is dense: same strides
    sm_scale = q.shape[-1] ** -0.5
    _bwd_dkdv_kernel[per_key](*args, dk, dv, *strides, sm_scale, **meta)
    _bwd_dq_kernel[per_query](*args, dq, *strides, sm_scale, DELTA_FROM_P=False, **meta)
    return dq, dk, dv


flash_bwd_op = torch.library.custom_op("nanolp::flash_bwd", flash_bwd, mutates_args=())


@flash_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, precision, from_p, fma):
    return tuple(torch.empty_like(o, dtype=q.dtype) for _ in range(3))


def direct(op, fn):
    """What an eager call runs: the op's own function (fn), not its dispatch, which costs more host time per call
    than the kernels take at short sequences (results/speed/host_path); torch.compile gets the op (opaque)."""
    return op if torch.compiler.is_compiling() else fn


class _FlashAttention(torch.autograd.Function):
    """flash_fwd_op, differentiable in O through flash_bwd_op; lse and the O delta reads are not (no zeros are
    made for their gradients)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, fix, delta_from, precision, p_bits, o_bits, stochastic, fma):
        o, lse, *o_delta = direct(flash_fwd_op, flash_fwd)(q, k, v, causal, fix, delta_from, precision, p_bits,
                                                           o_bits, stochastic, fma)
        # THE FIX (4, the hand-off): the O that delta will read is saved, with fix "on" the fp32 O
        ctx.save_for_backward(q, k, v, *(o_delta or [o]), lse)
        ctx.args = (causal, precision, delta_from == "p", fma)
        ctx.mark_non_differentiable(lse, *o_delta)
        ctx.set_materialize_grads(False)
        return o, lse, *o_delta

    @staticmethod
    def backward(ctx, do, *_):   # (lse and the O delta reads have no gradient)
        if torch.is_grad_enabled():   # create_graph=True: dq, dk, dv would be constants, a second derivative wrong
            raise RuntimeError("flash_attention is differentiable once: its backward cannot build a graph for a "
                               "second derivative (create_graph=True); use torch's scaled_dot_product_attention")
        q, k, v, o, lse = ctx.saved_tensors
        return *direct(flash_bwd_op, flash_bwd)(do, q, k, v, o, lse, *ctx.args), *(None,) * 8


Outputs = namedtuple("Outputs", "o lse o_delta")


def forward(q, k, v, *, fix, causal=True, numerics=None):
    """The forward as flash_attention runs it, for tests and experiments; the one check of its arguments.

    causal, fix, numerics: flash_attention's. v is read as given (the "vo" amplifier's rounding, amplified_v, is
    the caller's).
    Returns Outputs(o, lse, o_delta): o the O returned (q's dtype; differentiable, as flash_attention's), lse
    each row's log-sum-exp (fp32; log2 units in "fa2"), o_delta the O the backward's delta reads: the fp32 O with
    fix "on" or delta "fp32-o" (THE FIX), a stochastic rounding of it with delta "stochastic-o", else o itself."""
    numerics = as_numerics(numerics)
    check_inputs(q, k, v, causal, fix, numerics)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension (head_dim); "
                             "call .contiguous()")
    check_launch(q, k, v)   # (shapes first: a meta tensor's shape is checked before its device refused)
    check_device(q)
    o, lse, *o_delta = _FlashAttention.apply(q, k, v, causal, fix, numerics.delta, numerics.precision,
                                             numerics.p_bits, numerics.o_bits, numerics.stochastic_o == "forward",
                                             numerics.fma)
    return Outputs(o, lse, *(o_delta or [o]))


def flash_attention(q, k, v, causal=True, fix="on", numerics=None):
    """Causal (or full) attention softmax(q k^T / sqrt(d)) v, FlashAttention-2 in Triton.

    q, k, v: (batch, heads, seq, head_dim), bf16 or fp16, on CUDA (or CPU: check_device); any strides with
        the last dimension contiguous; head_dim 16, 32, 64 or 128; seq from 1 up; batch * heads up to 65,535
        (check_launch).
    fix: "on" (the default here, for drop-in use; train.py's --fix defaults to "off", the failing setting): the
            backward's delta reads the forward's fp32 O (costs that fp32 O's store and its memory until the
            backward, where one can follow); O and every other number are fix "off"'s.
        "off": plain FlashAttention-2, whose backward reads the rounded O (the failure this file is about).
        "paper": the paper's rule, a tied row's max shifted up, for the experiments (it leaves O's final cast's
            error, which fails our runs); bf16 only; O is fix "off"'s up to the shift's rounding (docs/kernel.md).
    numerics: the experiments (Numerics), not for training models; None rounds as FlashAttention-2 does.
    Returns O, q's shape and dtype, seq-major where q is, else head-major (empty_in_layout_of), as are dQ, dK, dV
    in the backward (two
    passes, no atomics: the same bits every run).
    """
    numerics = as_numerics(numerics)
    # fix "on" where no backward can follow is fix "off": nothing would read the fp32 O, and O is the same bits
    # (what is not a tensor, forward refuses)
    if fix == "on" and numerics.delta == "o" and not (torch.is_grad_enabled() and
                                                      any(getattr(t, "requires_grad", True) for t in (q, k, v))):
        fix = "off"
    if numerics.o_bits:   # the "vo" amplifier rounds V before attention reads it: V checked before that
        check_inputs(q, k, v, causal, fix, numerics)
        v = amplified_v(v, numerics.o_bits)
    return forward(q, k, v, causal=causal, fix=fix, numerics=numerics).o
