"""The kernel's numerics in plain PyTorch: the oracle for kernels.py and the attention on machines without a GPU.

emulate_attention() runs the same algorithm as kernels.flash_attention: the same 64-key tiles, the same
running max / row sum / accumulator, the same rounding points in both precision modes, and the same fix; the
backward accumulates over the backward kernels' tiles in their order, that of the two-pass backward or of the
one-pass one (one_pass, experiments/launch_variants.py). It runs on any device, slowly (one Python iteration per tile).

How "the same" is made exact. The only operations whose result depends on an implementation's internal
order are the tile matrix products, the row sums and the transcendental functions (exp2, exp, log2, log).
Here each of them is evaluated in float64 and rounded once to float32, which is the correctly rounded
float32 result in all but astronomically rare cases. The test suite patches Triton's CPU interpreter to do
the same (nanolp/interp_patch.py), so the kernel and this file agree bit for bit and any difference is a
difference of algorithm or rounding point, never of summation order. On a GPU the kernel's tensor cores,
exp2 approximation and division (acc / l compiles to PTX's approximate div.full.f32) differ from this in the
last float32 bits, so there the two agree only to rounding.
"""
import math
from dataclasses import asdict

import torch

from kernels import (BWD_TUNING, TILE_N, Numerics, amplified_v, as_numerics, check_inputs, fix_constants,
                     output_and_delta_o, qk_scale_of, round_mantissa)


# The attentions (model.py's attn) with the kernel's numerics: the kernel, and on any device this emulation. Only
# they take fix and kernels.Numerics.
OURS = ("kernel", "emulate")


def kernel_only(attn, settings):
    """The names of the settings (fix, kernels.Numerics' fields: a dict that holds them) that only our kernel has,
    set other than plain where attn is not ours and would ignore them, silently; [] where attn is ours. The rule's
    one home: model.GPT refuses them, and so does train.py, in flags, before it writes anything (nanolp/runconfig.py)."""
    plain = dict(fix="off") | asdict(Numerics())
    return [] if attn in OURS else [k for k in plain if settings[k] != plain[k]]


# ---------------------------------------------------------------------------------------------------------
# Exactly rounded primitives (float64 inside, one rounding to float32)

def _dot(a, b):
    return torch.matmul(a.double(), b.double()).float()


def _rowsum(x):
    return x.double().sum(-1).float()


def _exp2(x):
    return torch.exp2(x.double()).float()


def _exp(x):
    return torch.exp(x.double()).float()


def _log2(x):
    return torch.log2(x.double()).float()


def _log(x):
    return torch.log(x.double()).float()


def _round(x, dtype):
    return x.to(dtype).float()


def fma_f32(a, b, c):
    """a * b + c rounded once to float32 (a fused multiply-add), for float32 tensors.

    a * b is exact in float64 (24 + 24 significant bits fit in 53), but the float64 sum is rounded, and rounding
    that to float32 again can land wrong: when the float64 sum falls exactly on a midpoint between two float32
    values, the float32 cast breaks the tie to even although the exact sum lay on one side of it. E.g. a = 1 +
    2^-18, b = 2^-24 (1 - 2^-18), c = 1 + 2^-23: the exact sum is 2^-60 below the midpoint 1 + 3 * 2^-24, so fma
    gives 1 + 2^-23, float64 rounds it onto the midpoint, and the cast to float32 gives 1 + 2^-22. The cure is
    rounding to odd: an inexact float64 sum is moved to the neighbour with an odd last bit on the exact sum's
    side (it is never a float32 midpoint then, and lies on the exact sum's side of every one), and from 53 bits
    to float32's 24 that gives the correctly rounded result (Boldo and Melquiond, 2008). The exact error of the
    float64 sum comes from TwoSum (Knuth): s + err = a * b + c exactly."""
    p, c = a.double() * b.double(), c.double()
    s = p + c
    p_part = s - c
    err = (p - p_part) + (c - (s - p_part))
    bits = s.view(torch.int64)
    even = (err != 0) & (bits & 1 == 0) & torch.isfinite(s)
    toward = torch.where((err > 0) == (s > 0), 1, -1)    # sign-magnitude: +1 moves away from zero
    return torch.where(even, bits + toward, bits).view(torch.float64).float()


def exponent(S, scale, m, fma):
    """S * scale - m, the argument of exp2 in "fa2" (kernels._exp2): one rounding with fma, as FlashAttention-2
    computes it, else two, as PyTorch builds it."""
    if fma:
        return fma_f32(S, scale.expand_as(S), (-m).expand_as(S))
    return S * scale - m


# ---------------------------------------------------------------------------------------------------------
# The paper's rule (fix "paper")

def shifted_max(S, r, t, shift):
    """The row max to subtract from this tile's scaled scores S, and the new raw row max (kernels._shifted_max;
    shift: its constants, kernels.fix_constants).

    r = rowmax(S), t = the raw (unshifted) row max of the earlier tiles. If two or more unmasked scores of this
    tile lie within tol of r, or r lies within tol of t (a tie across tiles), move the max up by d > 0, so that
    no probability P = exp(S - max) of this tile is exactly 1 and its rounding is not one-sided. d is the paper's
    shift ((beta - 1) r for r > 0, -r for r < 0, i.e. max -> beta r or 0), folded into [lo, hi) when it leaves
    that range: never so small that exp(-d) rounds back to 1, never so large that exp(-d) underflows.
    """
    n_near = (S >= (r - shift.tol).unsqueeze(-1)).sum(-1)     # (the kernel: second-largest score >= r - tol)
    across = (r >= t - shift.tol) & (t >= r - shift.tol)
    tied = ((n_near > 1) | across) & (r > -math.inf)          # a fully masked tile (r = -inf) is never a tie
    d = torch.where(r > 0, (torch.tensor(shift.beta, dtype=torch.float32) - 1.0) * r, -r)
    d = torch.where((d >= shift.lo) & (d < shift.hi), d, shift.lo + torch.fmod(d, shift.span))
    return torch.where(tied, r + d, r), torch.maximum(t, r)


# ---------------------------------------------------------------------------------------------------------
# Forward: FlashAttention-2, one key tile at a time, all query rows at once (rows are independent).

def scale_of(q, precision):
    """qk_scale as the kernel holds it, in float32."""
    return torch.tensor(qk_scale_of(q.shape[-1], precision), dtype=torch.float32, device=q.device)


def scores(q, kt, precision, dtype):
    """S for one key tile as the exponent reads it, exactly as kernels._scores (fa2: Q K^T in fp32, its scale
    applied in the exponent; autocast: scaled, in nats, rounded twice)."""
    S = _dot(q, kt.transpose(-1, -2))
    if precision == "fa2":
        return S
    return _round(_round(S, dtype) * scale_of(q, precision), dtype)


def _mask(S, col0, n_keys, causal):
    rows = torch.arange(S.shape[-2], device=S.device).unsqueeze(-1)
    cols = col0 + torch.arange(S.shape[-1], device=S.device).unsqueeze(0)
    valid = cols < n_keys
    if causal:
        valid = valid & (cols <= rows)
    return S.masked_fill(~valid, -math.inf)


def forward(q, k, v, causal=True, shift=False, numerics=Numerics()):
    """Returns (O in the input dtype, O before its cast to that dtype in fp32, lse in the kernel's units), with
    the paper's shift on or off: the kernel's epilogue, which stores the fp32 O beside O only where it is read
    (kernels.flash_fwd's keep_o32, _fwd_kernel's KEEP_O32); the mechanism tests use it to show what it carries."""
    dtype = q.dtype
    B, H, N, D = q.shape
    precision, p_bits, o_bits = numerics.precision, numerics.p_bits, numerics.o_bits
    low = (lambda x: round_mantissa(x, p_bits)) if p_bits else (lambda x: x)                 # the amplifier
    q, k, v = q.float(), k.float(), v.float()
    m = torch.full((B, H, N), -math.inf, device=q.device)
    t = m.clone()                      # the raw running max (the paper's shift is not in it)
    l = torch.zeros((B, H, N), device=q.device)
    acc = torch.zeros((B, H, N, D), device=q.device)
    for col0 in range(0, N, TILE_N):
        kt, vt = k[:, :, col0:col0 + TILE_N], v[:, :, col0:col0 + TILE_N]
        S = _mask(scores(q, kt, precision, dtype), col0, N, causal)
        scale = scale_of(q, precision) if precision == "fa2" else torch.ones((), device=q.device)
        r = S.amax(-1) * scale     # rowmax(S * scale): the scale rounds monotonically
        if shift:   # fix_constants: tol and the shift's range, in log2 units for "fa2"
            r, t = shifted_max(S * scale, r, t, fix_constants(precision, p_bits))
        if precision == "fa2":
            m_new = torch.maximum(m, r)
            alpha = _exp2(m - m_new)
            P = _exp2(exponent(S, scale, m_new.unsqueeze(-1), numerics.fma))
            l = l * alpha + _rowsum(P)
            acc = acc * alpha.unsqueeze(-1) + _dot(_round(low(P), dtype), vt)   # P rounded right before P V
        else:  # "autocast": every intermediate held in the input dtype, as under bf16 autocast in PyTorch
            m_new = _round(torch.maximum(m, r), dtype)
            alpha = _round(_exp(_round(m - m_new, dtype)), dtype)
            P = _round(low(_exp(_round(S - m_new.unsqueeze(-1), dtype))), dtype)
            l = _round(_round(alpha * l, dtype) + _round(_rowsum(P), dtype), dtype)
            acc = _round(_round(acc * alpha.unsqueeze(-1), dtype) + _round(_dot(P, vt), dtype), dtype)
        m = m_new
    o32 = acc / l.unsqueeze(-1)
    if o_bits:  # the "vo" amplifier rounds O before it is stored
        o32 = round_mantissa(o32, o_bits)
    lse = m + (_log2(l) if precision == "fa2" else _log(l))
    return o32.to(dtype), o32, lse                                                     # ROUND: O


# ---------------------------------------------------------------------------------------------------------
# Backward: the same S, P recomputed from the saved lse, in the tiles of the backward kernels (BWD_TUNING, or
# the one-pass backward's, one_pass): dK and dV summed over query tiles of BLOCK_M rows, dQ over key
# tiles of BLOCK_N. A kernel's loop adds exactly rounded tile products in fp32, in order, from zero: Python's
# sum() over the tiles does the same. (The tiles a causal kernel skips add exact zeros here, which changes
# nothing.) The one-pass backward's dQ is summed in the order its programs add to the fp32 buffer
# (_dq_one_pass). delta is the two-pass backward's in both (kernels.bwd_delta).

def _tiles(n, block):
    """The tiles of `block` queries or keys, in the order a kernel's loop or the interpreter's grid runs them."""
    return [slice(i, i + block) for i in range(0, n, block)]


def _delta_tiles(n, head_dim):
    """The key tiles the paper's control sums delta over: the two-pass dQ kernel's, for both backwards."""
    return _tiles(n, BWD_TUNING[head_dim][1])


def _probs_and_dp(q, k, v, lse, do, causal, precision, fma=True):
    """P = exp(S - lse) (exp2 in "fa2"), its exponent rounded exactly as in the forward, and dP = dO V^T, in
    fp32."""
    S = _mask(scores(q, k, precision, q.dtype), 0, q.shape[-2], causal)
    if precision == "fa2":
        P = _exp2(exponent(S, scale_of(q, precision), lse.unsqueeze(-1), fma))
    else:
        P = _exp(S - lse.unsqueeze(-1))
    return P, _dot(do, v.transpose(-1, -2))


def delta(q, k, v, o, lse, do, causal, precision, from_p=False, fma=True):
    """The backward's delta. rowsum(dO * O) from the stored O, the paper's channel (kernels._bwd_delta_kernel);
    from_p: the paper's localisation control rowsum(dP * P), divided by rowsum(P) in "autocast", P recomputed in
    fp32 and O never read, both sums accumulated per key tile as kernels._bwd_dq_kernel does in its DELTA_FROM_P
    pass (one more pass over the keys)."""
    if not from_p:
        return _rowsum(do.float() * o.float())
    P, dP = _probs_and_dp(q, k, v, lse, do, causal, precision, fma)
    tiles = _delta_tiles(*q.shape[-2:])
    delta = sum(_rowsum((P * dP)[..., cols]) for cols in tiles)
    if precision == "autocast":
        delta = delta / sum(_rowsum(P[..., cols]) for cols in tiles)
    return delta


def _dq_one_pass(dS, k, block_m, block_n):
    """dQ before its scale as the one-pass backward sums it (experiments/launch_variants.py): each
    key tile's program adds dS_ij K_j into the fp32 buffer (zeros) for each query tile i in turn, by
    atomics, and the CPU interpreter runs the programs in launch order, key tile 0 first. (On a GPU the order
    of the key tiles' additions varies from run to run.) Per query tile that is the key tiles in ascending
    order from zero, the dQ kernel's sum: with the same key tiles (block_n), the same bits as the two-pass
    backward, which a test checks."""
    N = dS.shape[-1]
    dq = torch.zeros(dS.shape[:-1] + k.shape[-1:], device=dS.device)
    for cols in _tiles(N, block_n):        # the programs, in the order the interpreter runs them
        for rows in _tiles(N, block_m):    # a program's loop over the query tiles
            dq[..., rows, :] += _dot(dS[..., rows, cols], k[..., cols, :])
    return dq


def backward(q, k, v, o, lse, do, causal, precision, from_p=False, fma=True, one_pass=None):
    """dQ, dK, dV of the two-pass backward; one_pass (block_m, block_n): of the one-pass backward at those tiles."""
    dtype = q.dtype
    N, D = q.shape[-2:]
    scale = D ** -0.5
    P, dP = _probs_and_dp(q, k, v, lse, do, causal, precision, fma)
    dS = _round(P * (dP - delta(q, k, v, o, lse, do, causal, precision, from_p, fma).unsqueeze(-1)), dtype)
    P = _round(P, dtype)
    block_m, block_n = one_pass or BWD_TUNING[D][:2]
    if not one_pass:
        dq = sum(_dot(dS[..., cols], k[..., cols, :]) for cols in _tiles(N, block_n)) * scale   # over key tiles
    else:
        dq = _dq_one_pass(dS, k, block_m, block_n) * scale
    queries = _tiles(N, block_m)
    dk = sum(_dot(dS[..., rows, :].mT, q[..., rows, :]) for rows in queries) * scale     # over query tiles
    dv = sum(_dot(P[..., rows, :].mT, do[..., rows, :]) for rows in queries)
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


class _EmulatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, fix, numerics, one_pass):
        o, o32, lse = forward(q, k, v, causal, fix == "paper", numerics)
        stochastic = numerics.stochastic_o == "forward"
        o, o_delta = output_and_delta_o(o, o32, fix, stochastic, numerics.delta)   # THE FIX (3), as kernels.py
        ctx.save_for_backward(q, k, v, o_delta, lse)   # THE FIX (4): the O that delta will read
        ctx.args = (causal, numerics.precision, numerics.delta == "p", numerics.fma, one_pass)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        with torch.autocast(q.device.type, enabled=False):
            return (*backward(q, k, v, o, lse, do.contiguous(), *ctx.args), *[None] * 4)


def emulate_attention(q, k, v, causal=True, *, fix, numerics=None, one_pass=None):
    """Same arguments and result as kernels.flash_attention, computed tile by tile in PyTorch (with one_pass,
    (block_m, block_n), the one-pass backward's at those tiles, dQ as the CPU interpreter sums it); fix is the
    caller's (model.py's, a test's): flash_attention's default is the drop-in's."""
    numerics = as_numerics(numerics)
    check_inputs(q, k, v, causal, fix, numerics)
    v = amplified_v(v, numerics.o_bits)
    with torch.autocast(q.device.type, enabled=False):
        return _EmulatedAttention.apply(q, k, v, causal, fix, numerics, one_pass)


def emulate_forward_fp32(q, k, v, *, fix, causal=True, numerics=None):
    """The forward's O before its final cast (no autograd): kernels.forward's o_delta with delta "fp32-o", what
    delta reads with fix "on"."""
    numerics = as_numerics(numerics)
    check_inputs(q, k, v, causal, fix, numerics)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        return forward(q, k, amplified_v(v, numerics.o_bits), causal, fix == "paper", numerics)[1]


# The float reference the kernel approximates: the scores of fp32 attention (model.py) and of the diagnostics

def causal_scores(q, k):
    """Scaled scores S = q k^T / sqrt(d) in float32, with -inf above the diagonal."""
    T = q.size(-2)
    # autocast would cast the fp32 operands straight back to bf16, so it is switched off here
    with torch.autocast(q.device.type, enabled=False):
        S = q.float() @ k.float().transpose(-2, -1) / math.sqrt(q.size(-1))
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    return S.masked_fill(future, float("-inf"))
