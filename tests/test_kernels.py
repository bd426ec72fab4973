"""kernels.py against nanolp/emulate.py (bit for bit) and against float64 attention (within bf16 error).

Runs on the CPU through Triton's interpreter (patched in conftest.py); on a GPU the same file runs on the
compiled kernel (`python -m pytest tests/test_kernels.py` with CUDA and without TRITON_INTERPRET), where the
bitwise tests are skipped: tensor cores and the GPU's exp2 differ from float64-rounded results in the last bit.
"""
import math
import os
import re
from fractions import Fraction
import subprocess
import sys
import zlib
from dataclasses import replace
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import kernels
from experiments.curvature import bf16_neighbours
from experiments.launch_variants import tuned
from nanolp import emulate
from kernels import Numerics, round_mantissa

INTERPRETED = kernels.INTERPRET
DEVICE = "cpu" if INTERPRETED else "cuda"
requires_interpreter = pytest.mark.skipif(not INTERPRETED, reason="bitwise equality holds under the interpreter")


# Inputs drawn without a seed come from one generator seeded from the test's id (with its parameters), so a
# failing test draws the same inputs when it is run again, alone or with the others.
_inputs = torch.Generator()


@pytest.fixture(autouse=True)
def _seed_inputs(request):
    _inputs.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def rand(shape, dtype=torch.bfloat16, scale=1.0, seed=None):
    g = _inputs if seed is None else torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


def reference_probs(q, k, causal):
    """P = softmax(Q K^T * scale), in the dtype of q and k."""
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = q.shape[-2]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(S, -1)


def reference(q, k, v, causal):
    """float64 softmax attention on the same (rounded) inputs, with float64 autograd."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    return reference_probs(q, k, causal) @ v, (q, k, v)


def plain_attention(q, k, v, causal):
    """What PyTorch does in bf16 without flash attention: every op rounds to the input dtype."""
    S = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(S, -1) @ v


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.fixture
def poisoned():
    """Every buffer the kernel allocates starts as NaN, so an element it forgets to write shows up."""
    empty, empty_like = torch.empty, torch.empty_like
    with mock.patch.object(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(math.nan)), \
            mock.patch.object(torch, "empty_like", lambda *a, **kw: empty_like(*a, **kw).fill_(math.nan)):
        yield


# -------------------------------------------------------------------------------------------------------
# Forward: bit for bit against the emulation

SHAPES = [(1, 2, 130, 64), (2, 1, 1, 16), (1, 3, 77, 32), (1, 1, 200, 128), (1, 1, 64, 64)]


@requires_interpreter
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("fix", ["off", "paper"])
@pytest.mark.parametrize("causal", [True, False])
def test_forward_bitwise_equals_emulation(shape, precision, fix, causal, poisoned):
    q, k, v = rand(shape, scale=2.0), rand(shape), rand(shape)
    k[..., 5 % shape[2], :] = k[..., 3 % shape[2], :]          # exact ties, so the fix has work to do
    q[..., 0, :] *= 40                                           # a row with a max far above 64 nats
    o, lse, _ = kernels.forward(q, k, v, causal=causal, fix=fix, numerics=Numerics(precision=precision))
    o_ref, _, lse_ref = emulate.forward(q, k, v, causal, fix == "paper", Numerics(precision=precision))
    assert torch.equal(o.view(torch.int16), o_ref.view(torch.int16)), "O differs from the emulation"
    assert torch.equal(lse, lse_ref), "lse differs from the emulation"


@requires_interpreter
@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
def test_forward_bitwise_with_wide_query_tiles(precision, D, monkeypatch):
    """With 128-row query tiles (the GPU's, at every head_dim) some rows meet key tiles that are fully masked for
    them."""
    q, k, v = rand((1, 2, 300, D), scale=3.0), rand((1, 2, 300, D)), rand((1, 2, 300, D))
    for fix in ("off", "paper"):
        with tuned(fwd={D: (128, 4, 1)}):
            o, lse, _ = kernels.forward(q, k, v, fix=fix, numerics=Numerics(precision=precision))
        o_ref, _, lse_ref = emulate.forward(q, k, v, True, fix == "paper", Numerics(precision=precision))
        assert torch.equal(o.view(torch.int16), o_ref.view(torch.int16)) and torch.equal(lse, lse_ref)


@requires_interpreter
def test_forward_candidate_settings_keep_the_bits_and_leave_the_tuning():
    """experiments/forward_split.py --fwd times other forward settings against FWD_TUNING's; other query tiles,
    warps, stages and a register cap change where a row is computed, not how, and kernels.py is as before after."""
    from experiments.forward_split import FwdConfig, forward_config
    before = dict(kernels.FWD_TUNING), kernels.TILE_N, kernels._fwd_kernel
    q, k, v = rand((1, 2, 300, 128), scale=3.0), rand((1, 2, 300, 128)), rand((1, 2, 300, 128))
    for fix in ("off", "paper", "on"):
        reference = kernels.forward(q, k, v, fix=fix)
        for config in (FwdConfig(64, 4, 1, 168), FwdConfig(128, 8, 2, 128)):
            with forward_config(128, config):
                out = kernels.forward(q, k, v, fix=fix)
            assert all(torch.equal(a, b) for a, b in zip(out, reference)), (config, fix)
    assert (dict(kernels.FWD_TUNING), kernels.TILE_N, kernels._fwd_kernel) == before
    assert FwdConfig.parse("128/8/2/block_n=32/maxnreg=128") == FwdConfig(128, 8, 2, 128, 32)
    assert str(FwdConfig(128, 8, 2, 128, 32)) == "128/8/2/maxnreg=128/block_n=32"


@requires_interpreter
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("fix", ["off", "paper"])
@pytest.mark.parametrize("amplify", ["p", "vo"])
def test_forward_bitwise_fewer_mantissa_bits(precision, fix, amplify):
    """The amplifier (P rounded to 3 mantissa bits before P V, as in FP8 e4m3 attention; or O before its store)
    is emulated exactly, and so is the fp32 O that delta "fp32-o" keeps (rounded to O_BITS with "vo", not cast)."""
    q, k, v = rand((1, 2, 100, 64), scale=2.0), rand((1, 2, 100, 64)), rand((1, 2, 100, 64))
    k[..., 7, :] = k[..., 9, :]
    numerics = Numerics(precision=precision, mantissa_bits=3, amplify=amplify)
    o, lse, _ = kernels.forward(q, k, v, fix=fix, numerics=numerics)
    o_ref, _, lse_ref = emulate.forward(q, k, v, True, fix == "paper", numerics)
    assert torch.equal(o.view(torch.int16), o_ref.view(torch.int16)) and torch.equal(lse, lse_ref)
    o_bf16, _, _ = emulate.forward(q, k, v, True, fix == "paper", Numerics(precision=precision))
    assert not torch.equal(o, o_bf16), "the amplifier must change the result"
    o32 = kernels.forward(q, k, v, fix=fix, numerics=replace(numerics, delta="fp32-o")).o_delta
    assert torch.equal(o32, emulate.forward(q, k, v, True, fix == "paper", numerics)[1])


# -------------------------------------------------------------------------------------------------------
# Gradients: bit for bit against the emulation, with delta from O, from P (the paper's control) or from an fp32 O

DELTAS = {delta: Numerics(delta=delta) for delta in ("o", "p", "fp32-o")}

def grads(attention, q, k, v, do, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    attention(q, k, v, **kw).backward(do)
    return q.grad, k.grad, v.grad


@requires_interpreter
@pytest.mark.parametrize("shape", [(1, 2, 100, 64), (2, 1, 130, 32)])
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("delta_from", list(DELTAS))
def test_gradients_bitwise_equal_emulation(shape, precision, causal, delta_from, poisoned):
    """delta itself first: the gradients show its last bits only where they tip a rounding of dS to bf16."""
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    numerics = replace(DELTAS[delta_from], precision=precision)
    o, lse, o32 = kernels.forward(q, k, v, causal=causal, fix="off", numerics=numerics)
    o_want, o32_want, _ = emulate.forward(q, k, v, causal, False, numerics)
    assert torch.equal(o, o_want)                         # the returned O is the same with every delta
    if delta_from == "fp32-o":
        assert torch.equal(o32, o32_want)                 # delta "fp32-o" keeps O before its cast for delta
        o = o32
    delta = kernels.bwd_delta(do, q, k, v, o, lse, causal, precision, delta_from == "p", True)
    assert torch.equal(delta, emulate.delta(q, k, v, o, lse, do, causal, precision, delta_from == "p"))
    ours = grads(kernels.flash_attention, q, k, v, do, causal=causal, fix="off", numerics=numerics)
    want = grads(emulate.emulate_attention, q, k, v, do, causal=causal, fix="off", numerics=numerics)
    for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
        assert a.dtype == q.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), \
            f"{name} differs from the emulation"
    other = grads(emulate.emulate_attention, q, k, v, do, causal=causal, fix="off",
                  numerics=replace(DELTAS["p" if delta_from == "o" else "o"], precision=precision))
    assert not torch.equal(ours[0], other[0]), "two ways of computing delta must give different bits here"


@requires_interpreter
@pytest.mark.parametrize("causal", [True, False])
def test_one_tiles_gradients_read_ds_and_p_rounded_as_flash_attention_2_does(causal):
    """Within one tile the backward's three products, written out: dS = P (dP - delta) and P rounded to the inputs'
    dtype before the tensor cores read them, dQ = dS K and dK = dS^T Q summed in fp32 and scaled by head_dim^-1/2 at
    the store, dV = P^T dO. The emulation is checked against the kernel elsewhere; this pins both to the formulas,
    where a rounding dropped from both alike would still agree (head_dim 32: a scale that is no power of two)."""
    q, k, v, do = rand((1, 1, 64, 32), scale=2.0), rand((1, 1, 64, 32)), rand((1, 1, 64, 32)), rand((1, 1, 64, 32))
    o, lse, _ = kernels.forward(q, k, v, causal=causal, fix="off", numerics=Numerics())
    P, dP = emulate._probs_and_dp(q, k, v, lse, do, causal, "fa2")
    dS = (P * (dP - emulate.delta(q, k, v, o, lse, do, causal, "fa2").unsqueeze(-1))).to(q.dtype)   # ROUND: dS
    matmul = lambda a, b: (a.double() @ b.double()).float()   # a tile's fp32 sum (in float64: the same bf16 bits)
    scale = torch.tensor(32 ** -0.5, dtype=torch.float32)
    want = ((matmul(dS, k) * scale).to(q.dtype), (matmul(dS.mT, q) * scale).to(q.dtype),
            matmul(P.to(q.dtype).mT, do).to(q.dtype))                                                 # ROUND: P
    for name, a, b in zip(("dQ", "dK", "dV"), grads(kernels.flash_attention, q, k, v, do, causal=causal, fix="off"),
                          want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} is not the formula's"


def test_vo_amplifier_rounds_v_for_both_passes_and_passes_its_gradient_through():
    """amplify="vo": attention reads V rounded to mantissa_bits in the forward and the backward alike (the
    result equals plain attention on the rounded V), and dV reaches the unrounded V unchanged."""
    shape = (1, 2, 100, 64)
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    v3 = round_mantissa(v, 3).to(v.dtype)
    assert not torch.equal(v3, v)
    vo = Numerics(mantissa_bits=3, amplify="vo")
    for attention in (kernels.flash_attention, emulate.emulate_attention):
        ours = grads(attention, q, k, v, do, fix="off", numerics=vo)
        on_v3 = grads(attention, q, k, v3, do, fix="off", numerics=vo)
        for name, a, b in zip(("dQ", "dK", "dV"), ours, on_v3):
            assert torch.equal(a, b), f"{attention.__name__}: {name} must equal the gradient at the rounded V"
    plain = grads(kernels.flash_attention, q, k, v3, do, fix="off")
    assert not torch.equal(ours[0], plain[0]), "O rounded to 3 bits must change delta and so dQ"


@requires_interpreter
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_gradients_bitwise_equal_emulation_at_every_tuning(D, poisoned):
    """Each head_dim's backward tiles as the GPU runs them (BWD_TUNING), bit for bit against the emulation in
    both precisions, at a length of five key tiles of 64 (the backward's at every head_dim), the last one ragged."""
    shape = (1, 2, 300, D)
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    for precision in ("fa2", "autocast"):
        numerics = Numerics(precision=precision)
        ours = grads(kernels.flash_attention, q, k, v, do, fix="off", numerics=numerics)
        want = grads(emulate.emulate_attention, q, k, v, do, fix="off", numerics=numerics)
        for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{precision}: {name} differs"


# -------------------------------------------------------------------------------------------------------
# Forward and gradients against float64, within twice the error of plain bf16 attention

def check_against_float64(q, k, v, causal, numerics=Numerics(), fix="off", attention=kernels.flash_attention,
                          factor=2.0, autocast=False, yardstick=plain_attention):
    """O, dQ, dK, dV within factor x the float64 error of yardstick(q, k, v, causal): plain bf16 attention."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    do = rand(q.shape, q.dtype)
    with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
        o = attention(q, k, v, causal=causal, fix=fix, numerics=numerics)
    o.backward(do)
    ours = (o, q.grad, k.grad, v.grad)
    ref, leaves = reference(q, k, v, causal)
    ref.backward(do.double())
    refs = (ref, *(t.grad for t in leaves))
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    op = yardstick(qp, kp, vp, causal)
    op.backward(do)
    plain = (op, qp.grad, kp.grad, vp.grad)
    for name, a, r, p in zip(("O", "dQ", "dK", "dV"), ours, refs, plain):
        assert torch.isfinite(a).all(), f"{name} not finite"
        bound = factor * rel(p, r) + 1e-5
        assert rel(a, r) <= bound, f"{name}: rel err {rel(a, r):.2e} > {factor} x {rel(p, r):.2e}"


@pytest.mark.parametrize("seed", range(6))
def test_gradients_random_shapes(seed, poisoned):
    g = torch.Generator().manual_seed(seed)
    B, H = (int(x) for x in torch.randint(1, 3, (2,), generator=g))
    N = int(torch.randint(1, 160, (1,), generator=g))
    D = [16, 32, 64, 128][seed % 4]
    dtype = [torch.bfloat16, torch.float16][seed % 2]
    causal = seed % 3 != 0
    fix = {2: "on", 3: "on", 4: "paper"}.get(seed, "off")   # (the paper's rule takes bf16 inputs alone: seed 4's)
    q, k, v = (rand((B, H, N, D), dtype, seed=seed * 3 + i) for i in range(3))
    check_against_float64(q, k, v, causal, fix=fix)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs every setting unpipelined; this is for the GPU's")
@pytest.mark.parametrize("N", [kernels.SHORT_SEQ, kernels.SHORT_SEQ + 77])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
@pytest.mark.parametrize("causal, fix", [(True, "off"), (False, "off"), (True, "on"), (False, "on")])
def test_gradients_every_tuning_setting(N, D, causal, fix, poisoned):
    """Each head_dim's forward and backward settings (stages differ per head_dim and across SHORT_SEQ)."""
    q, k, v = (rand((2, 2, N, D), seed=D + i) for i in range(3))
    check_against_float64(q, k, v, causal, fix=fix)


@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("fix", ["off", "on", "paper"])
@pytest.mark.parametrize("causal", [True, False])
def test_gradients_precision_modes(precision, fix, causal):
    q, k, v = (rand((2, 2, 96, 64), scale=s) for s in (2.0, 1.0, 1.0))
    check_against_float64(q, k, v, causal, Numerics(precision=precision), fix)


@pytest.mark.parametrize("precision", ["fa2", "autocast"])
def test_gradients_autocast_large_logits(precision):
    """Row maxima of a few hundred nats. A backward that rounds S unlike the forward gets P = exp(S - lse)
    wrong by factors of e here (bf16 spacing is 1-2 at these logits) and fails by orders of magnitude. Plain bf16
    attention's own error is large here (dQ's ~0.2), so the yardstick is the emulation's: the kernel's algorithm
    in PyTorch (dQ's error ~7e-3 in "fa2"), which a backward that rounds unlike it misses by far more than 2x."""
    q, k, v = rand((1, 2, 128, 64), scale=1.0), rand((1, 2, 128, 64)), rand((1, 2, 128, 64))
    q = q * (300 / (q @ k.transpose(-1, -2) / 8).amax())
    q = q.to(torch.bfloat16)
    for fix in ("off", "on", "paper"):
        numerics = Numerics(precision=precision)
        emulated = lambda q, k, v, causal, fix=fix: emulate.emulate_attention(q, k, v, causal=causal, fix=fix,
                                                                             numerics=numerics)
        check_against_float64(q, k, v, True, numerics, fix, autocast=True)
        check_against_float64(q, k, v, True, numerics, fix, autocast=True, yardstick=emulated)


def ds_residue_atol(q, k, v, do, causal):
    """Bounds on the absolute error of dQ and dK that a GPU leaves where the exact dS = P * (dP - delta) cancels.
    In a one-hot row O = V_j, so dP_ij = dO_i . V_j and delta_i = dO_i . O_i are the same sum, and dS_ij is 0; but
    the kernel sums dP on tensor cores and delta in a reduction, in different orders, and dS keeps the difference
    of their fp32 rounding errors. A sum of d fp32 terms in any order is within (d - 1) * 2^-24 of the sum of
    their magnitudes (tensor cores round fewer times, once a 16-wide chunk, within 2^-23 each), so with c = d:
        |error of dS_ij| <= P_ij * c * 2^-24 * sum_d |dO_id| * (|V_jd| + |O_id|)
    and dQ = scale * dS K, dK = scale * dS^T Q carry at most scale * err_dS |K| and scale * err_dS^T |Q|: the
    residue grows with |Q| and |K|, which the logits set, so no flat atol fits. Returns (atol_dQ, atol_dK)."""
    q, k, v, do = (t.detach().double() for t in (q, k, v, do))
    p = reference_probs(q, k, causal)
    o, scale = p @ v, q.shape[-1] ** -0.5
    magnitudes = do.abs() @ v.abs().transpose(-1, -2) + (do.abs() * o.abs()).sum(-1, keepdim=True)
    err_ds = p * q.shape[-1] * 2.0 ** -24 * magnitudes
    return scale * err_ds @ k.abs(), scale * err_ds.transpose(-1, -2) @ q.abs()


@pytest.mark.parametrize("exponent", ["fma", "torch"])
@pytest.mark.parametrize("logit", [1e6, 1e9])
def test_runaway_logits(logit, exponent):
    """Logits as large as the collapsing runs reach (layer 0 at 1e6-1e9 before the loss goes non-finite): every row
    is one-hot, so O is the top key's V and the exact gradients of Q and K are ~0. With either exponent, with and
    without the fix, no inf or NaN, even where rows hold exactly tied maxima (key 5 copied, value included, to key
    9): a non-finite loss at those logits is not the kernel overflowing. Tied rows are checked for finiteness only:
    lse = m + log2(l) is fp32, whose spacing passes 1 at 2^24 (logits ~1.2e7), so at 1e9 a tie's log2(2) is lost.
    256 keys: on a GPU (128-row forward programs) rows past 128 find their top key in the tiles left of the
    diagonal, the loop without masks.
    exponent="torch" (S * scale rounded, then the max subtracted) is exact there: the top key's P is exactly 1.
    exponent="fma", as FlashAttention-2 ships it, is not: the backward's P of the top key is 2^rho, rho the exact
    S * scale - lse, up to half an ulp of lse (1/16 at 1e6, 64 at 1e9), so dV is off by up to 2^rho - 1 (4% at
    1e6, 2^64 at 1e9; the forward's O is not, as l holds the same 2^rho), and dS = P * (dP - delta) no longer
    cancels: dK, exactly ~0, is above 1 (~1e4 at 1e6 and ~1e24 at 1e9 in the emulation)."""
    q, k, v = (rand((1, 2, 256, 64), seed=40 + i) for i in range(3))
    q = (q.float() * (logit / (q.float() @ k.float().transpose(-1, -2) / 8).amax())).to(torch.bfloat16)
    tied_k, tied_v = k.clone(), v.clone()
    tied_k[:, :, 9], tied_v[:, :, 9] = k[:, :, 5], v[:, :, 5]  # rows >= 9 that pick key 5 see it twice
    do = rand(q.shape, seed=43)
    ref, ref_inputs = reference(q, k, v, True)
    ref.backward(do.double())
    atol = dict(O=1e-5, dV=1e-5)      # on a GPU; O = V_j and dV = P^T dO hold no cancellation
    atol["dQ"], atol["dK"] = ds_residue_atol(q, k, v, do, True)
    # fma: half an ulp of the largest lse (log2 units), and what 2^rho makes of dV at most
    half_ulp = 2.0 ** (math.floor(math.log2(logit * 1.01 * kernels.LOG2E)) - 24)
    p_ref = reference_probs(q.double(), k.double(), True)
    dv_bound = (2.0 ** half_ulp - 1) * (p_ref.transpose(-1, -2) @ do.double().abs()) + 1e-2 * ref_inputs[2].grad.abs().max()
    for fix in ("off", "on", "paper"):
        for keys, values, exact in ((k, v, True), (tied_k, tied_v, False)):
            inputs = [t.clone().requires_grad_() for t in (q, keys, values)]
            o = kernels.flash_attention(*inputs, causal=True, fix=fix, numerics=Numerics(exponent=exponent))
            o.backward(do)
            got = dict(zip(("O", "dQ", "dK", "dV"), [o] + [t.grad for t in inputs]))
            want = dict(zip(("O", "dQ", "dK", "dV"), [ref] + [t.grad for t in ref_inputs]))
            for name, a in got.items():
                assert torch.isfinite(a).all(), f"{name} not finite (fix={fix}, tied={not exact})"
            if not exact:
                continue
            error = {name: (got[name].double() - want[name]).abs() for name in got}
            if exponent == "torch":   # the interpreter rounds dP and delta once each, from float64: dS cancels
                for name, r in want.items():   # (1e-30: float64's gradients of ~1e-59 are 0 in fp32, P underflows)
                    bound = 1e-2 * r.abs().max() + 1e-30 + (0 if kernels.INTERPRET else atol[name])
                    assert (error[name] <= bound).all(), f"{name} (fix={fix})"
            else:
                assert (error["O"] <= 1e-2 * want["O"].abs().max() + atol["O"]).all(), f"O (fix={fix})"
                assert (error["dV"] <= dv_bound).all(), f"dV beyond 2^rho (fix={fix})"
                assert error["dK"].max() > 1.0, f"dK cancels with the fused exponent (fix={fix})"


def round_to_f32(x):
    """The float32 nearest to the rational x, ties to even (exact: Fractions)."""
    near = np.float32(float(x))
    candidates = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(candidates, key=lambda y: (abs(Fraction(float(y)) - x), int(np.array(y).view(np.uint32)) & 1))


def fma_cases():
    """(a, b, c) in float32 where rounding a * b + c to float64 first lands on a float32 midpoint that the exact
    sum lies 2^-60 j^2 below (a = 1 + x, b = 2^-24 (1 - x), x = j 2^-18, c = 1 + i 2^-23, signs flipped too),
    then random triples."""
    g = np.random.default_rng(0)
    j = np.arange(1, 12, dtype=np.float64).repeat(16)
    i = g.integers(0, 2**23, j.size)
    sign = np.where(g.random(j.size) < 0.5, -1.0, 1.0)
    a = (1 + j * 2.0 ** -18) * sign
    b = 2.0 ** -24 * (1 - j * 2.0 ** -18)
    c = (1 + i * 2.0 ** -23) * sign
    random = g.standard_normal((3, 2048 - j.size)) * np.exp2(g.integers(-20, 20, (3, 2048 - j.size)))   # 2048 in all: a power of 2 for tl.arange
    return [torch.from_numpy(np.concatenate([x, r]).astype(np.float32)) for x, r in zip((a, b, c), random)]


def test_fma_rounds_once():
    """emulate.fma_f32 is a * b + c rounded once, also where float64 then float32 would round twice (the cases
    where that naive way fails are there: the test could fail), and the interpreter's tl.fma gives the same bits."""
    a, b, c = fma_cases()
    want = torch.tensor([round_to_f32(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                         for x, y, z in zip(a.tolist(), b.tolist(), c.tolist())])
    assert torch.equal(emulate.fma_f32(a, b, c), want)
    naive = (a.double() * b.double() + c.double()).float()
    assert (naive != want).sum() > 50, "the cases must include sums that round twice"
    if INTERPRETED:
        from nanolp.interp_patch import _fma_kernel
        out = torch.empty_like(a)
        _fma_kernel[(1,)](a, b, c, out, N=a.numel())
        assert torch.equal(out, want), "the interpreter's tl.fma is not a * b + c rounded once"


@requires_interpreter
@pytest.mark.parametrize("fix", ["off", "on", "paper"])
def test_both_exponents_bitwise_equal_emulation(fix, poisoned):
    """Both forms of the exponent (kernels._exp2), forward and backward, bit for bit; with rows at logits ~1e6,
    where the fused form's P_max = 2^residue (up to 2^(1/16)), the two forms give different O, lse and dV."""
    q, k, v, do = (rand((1, 2, 130, 64), seed=70 + i) for i in range(4))
    q[..., ::3, :] *= 30000
    results = {}
    for exponent in ("fma", "torch"):
        numerics = Numerics(exponent=exponent)
        o, lse, _ = kernels.forward(q, k, v, fix=fix, numerics=numerics)
        o_want, _, lse_want = emulate.forward(q, k, v, True, fix == "paper", numerics)
        assert torch.equal(o.view(torch.int16), o_want.view(torch.int16)) and torch.equal(lse, lse_want), exponent
        ours = grads(kernels.flash_attention, q, k, v, do, fix=fix, numerics=numerics)
        want = grads(emulate.emulate_attention, q, k, v, do, fix=fix, numerics=numerics)
        for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} ({exponent})"
        results[exponent] = (o, lse, ours[2])
    assert all(not torch.equal(a, b) for a, b in zip(results["fma"], results["torch"]))


def test_emulation_gradients_against_float64():
    q, k, v = (rand((2, 2, 70, 32)) for _ in range(3))
    for precision in ("fa2", "autocast"):
        check_against_float64(q, k, v, True, Numerics(precision=precision), "on", attention=emulate.emulate_attention)


@pytest.mark.parametrize("delta_from", ["p", "fp32-o"])
def test_delta_controls_against_float64(delta_from):
    q, k, v = (rand((1, 2, 80, 64)) for _ in range(3))
    for precision in ("fa2", "autocast"):
        check_against_float64(q, k, v, True, replace(DELTAS[delta_from], precision=precision))


def test_delta_from_the_fp32_o_returns_the_plain_forward_in_q_layout():
    """delta from the fp32 O (fix "on", or delta "fp32-o" with fix "off" or "paper") changes only what the backward
    reads: the O returned is the one without it, bit for bit, in q's dtype and layout; and so is O with delta
    "stochastic-o"."""
    # heads inside the sequence; requiring grad, as where fix "on" stores the fp32 O (else it runs fix "off")
    q, k, v = (rand((1, 37, 2, 32), seed=s).requires_grad_().transpose(1, 2) for s in range(3))
    off, paper = dict(fix="off"), dict(fix="paper")
    for plain, options in ((off, dict(fix="on")), (off, dict(off, numerics=Numerics(delta="fp32-o"))),
                           (paper, dict(paper, numerics=Numerics(delta="fp32-o"))),
                           (off, dict(off, numerics=Numerics(delta="stochastic-o")))):
        want = kernels.flash_attention(q, k, v, **plain)
        o = kernels.flash_attention(q, k, v, **options)
        assert o.dtype == q.dtype and o.stride() == want.stride() and torch.equal(o, want), options


def test_fix_on_keeps_no_fp32_o_where_no_backward_can_follow(monkeypatch):
    """flash_attention with fix "on" keeps the fp32 O only where a backward can follow (grad enabled and an
    input that requires it); otherwise it runs fix "off"'s forward, whose O is the same bits, and stores none."""
    kept, flash_fwd = [], kernels.flash_fwd

    def spy(*args):
        out = flash_fwd(*args)
        kept.append(len(out) == 3)                               # O, lse and the fp32 O
        return out
    monkeypatch.setattr(kernels, "flash_fwd", spy)
    q, k, v = (rand((1, 2, 19, 16), seed=s) for s in range(3))
    want = kernels.flash_attention(q, k, v, fix="off")
    trained = q.clone().requires_grad_()
    with torch.no_grad():
        o_no_grad = kernels.flash_attention(trained, k, v)
    o_no_input = kernels.flash_attention(q, k, v)
    o_grad = kernels.flash_attention(trained, k, v)
    assert kept == [False, False, False, True]
    assert all(torch.equal(o, want) for o in (o_no_grad, o_no_input, o_grad))


@requires_interpreter
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("seq_major", [True, False])
def test_fix_on_stores_o_and_its_fp32_o_from_one_epilogue(seq_major, precision, poisoned, monkeypatch):
    """With fix "on" the forward's epilogue stores the fp32 O beside O (KEEP_O32), both in q's layout with the
    same strides: O is the fp32 O it keeps rounded to nearest even, element for element (what the host's cast of
    it gave), and both are the emulation's bits; O and lse are fix "off"'s. With the paper's rule too (fix
    "paper", delta "fp32-o") O is the O of the kernel that keeps no fp32 O (fix "paper"), and fix "off"'s in every
    row that the shift leaves alone."""
    def inputs(seed, scale=1.0):
        if seq_major:                                            # heads inside the sequence, as model.py's
            return rand((1, 130, 2, 64), scale=scale, seed=seed).transpose(1, 2)
        return rand((1, 2, 130, 64), scale=scale, seed=seed)
    q, k, v = inputs(0, 2.0), inputs(1), inputs(2)
    k[..., 7, :] = k[..., 3, :]                                  # exact ties: rows that the shift moves
    numerics = Numerics(precision=precision)
    off = kernels.forward(q, k, v, fix="off", numerics=numerics)
    o, lse, o32 = kernels.forward(q, k, v, fix="on", numerics=numerics)
    assert torch.equal(o.view(torch.int16), off.o.view(torch.int16)) and torch.equal(lse, off.lse)
    o_want, o32_want, _ = emulate.forward(q, k, v, True, False, numerics)
    assert torch.equal(o.view(torch.int16), o_want.view(torch.int16)) and torch.equal(o32, o32_want)
    o, lse, o32 = kernels.forward(q, k, v, fix="paper", numerics=replace(numerics, delta="fp32-o"))
    assert o.dtype == q.dtype and o32.dtype == torch.float32
    assert o32.stride() == o.stride() == kernels.empty_in_layout_of(q).stride()
    assert torch.equal(o.view(torch.int16), o32.to(q.dtype).view(torch.int16)), "O is not the fp32 O's cast"
    moved = torch.zeros(q.shape[:3], dtype=torch.bool)           # the rows whose max the emulation shifts
    shifted_max = emulate.shifted_max

    def spy(S, r, t, shift):
        shifted, t = shifted_max(S, r, t, shift)
        moved.logical_or_(shifted != r)
        return shifted, t
    monkeypatch.setattr(emulate, "shifted_max", spy)
    o_want, o32_want, lse_want = emulate.forward(q, k, v, True, True, numerics)
    assert torch.equal(o.view(torch.int16), o_want.view(torch.int16)) and torch.equal(lse, lse_want)
    assert torch.equal(o32, o32_want), "the fp32 O differs from the emulation's"
    paper = kernels.forward(q, k, v, fix="paper", numerics=numerics)
    assert paper.o_delta is paper.o and torch.equal(paper.o, o) and torch.equal(paper.lse, lse)
    assert moved.any() and not moved.all()
    assert torch.equal(off.o[~moved], o[~moved]) and torch.equal(off.lse[~moved], lse[~moved])


OPTIONS = {"fix": ("on", {}), "paper rule": ("paper", {}), "paper rule and fix": ("paper", dict(delta="fp32-o")),
           "SR forward": ("off", dict(stochastic_o="forward")),
           "SR delta": ("off", dict(delta="stochastic-o")),
           "SR forward, fp32 delta": ("off", dict(stochastic_o="forward", delta="fp32-o"))}


@requires_interpreter
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("option", list(OPTIONS))
def test_fix_and_stochastic_rounding_bitwise_equal_emulation(option, precision, poisoned):
    """O and the gradients of the fix, the paper's rule, the two together and the stochastic-rounding experiments, bit
    for bit against the emulation (the stochastic roundings drawn from the same seeded generator)."""
    q, k, v, do = rand((1, 2, 100, 64), scale=2.0), rand((1, 2, 100, 64)), rand((1, 2, 100, 64)), rand((1, 2, 100, 64))
    k[..., 7, :] = k[..., 3, :]                                   # exact ties, so the shift has work to do
    results = []
    for attention in (kernels.flash_attention, emulate.emulate_attention):
        torch.manual_seed(0)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        fix, numerics = OPTIONS[option]
        o = attention(*inputs, fix=fix, numerics=Numerics(precision=precision, **numerics))
        o.backward(do)
        results.append([o] + [t.grad for t in inputs])
    for name, a, b in zip(("O", "dQ", "dK", "dV"), *results):
        assert a.dtype == q.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs"


@requires_interpreter
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("fix", ["off", "on"])
def test_float16_bitwise_equal_emulation(fix, causal, poisoned):
    """float16 inputs (every other bitwise test is bf16's), several batches and heads: O and the gradients of fix
    "off" and "on", bit for bit against the emulation, in both precisions."""
    shape = (2, 2, 77, 32)
    q, k, v, do = (rand(shape, torch.float16, scale=s) for s in (2.0, 1.0, 1.0, 1.0))
    for precision in ("fa2", "autocast"):
        results = []
        for attention in (kernels.flash_attention, emulate.emulate_attention):
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            o = attention(*inputs, causal=causal, fix=fix, numerics=Numerics(precision=precision))
            o.backward(do)
            results.append([o] + [t.grad for t in inputs])
        for name, a, b in zip(("O", "dQ", "dK", "dV"), *results):
            assert a.dtype == torch.float16 and torch.equal(a.view(torch.int16), b.view(torch.int16)), \
                f"{precision}: {name} differs"


def test_stochastic_forward_rounds_o_unbiased_within_one_step():
    """stochastic_o="forward": each element of O is one of the two bf16 neighbours of the fp32 O, and on average
    the fp32 O itself; round-to-nearest is not unbiased in that sense element by element, but both stay within a
    step."""
    q, k, v = (rand((4, 2, 128, 64), seed=s) for s in range(3))
    o32 = kernels.forward(q, k, v, fix="off", numerics=Numerics(delta="fp32-o")).o_delta
    down, up = bf16_neighbours(o32)
    o32 = o32.double()
    forward = Numerics(stochastic_o="forward")
    draws = torch.stack([kernels.flash_attention(q, k, v, fix="off", numerics=forward).double() for _ in range(8)])
    assert ((draws == down) | (draws == up)).all()
    step = (o32.abs() * 2.0 ** -7).clamp_min(1e-30)               # at least one bf16 step (2^-7 relative, or less)
    assert not torch.equal(draws[0], draws[1]), "two draws should differ"
    err = (draws - o32) / step
    assert err.mean().abs() < 4 * err.std() / err.numel() ** 0.5
    assert torch.equal(kernels.flash_attention(q, k, v, fix="off").double(), o32.to(torch.bfloat16).double())


# -------------------------------------------------------------------------------------------------------
# The fix and the paper's rule: exact in real arithmetic, robust at the edges

@pytest.mark.parametrize("precision", ["fa2", "autocast"])
def test_paper_rule_changes_only_rounding(precision):
    """The paper's shift is exact in real arithmetic: its O is fix "off"'s up to rounding; the fix's O is fix
    "off"'s, bit for bit."""
    q, k, v = (rand((2, 2, 150, 64)) for _ in range(3))
    k[..., 10, :] = k[..., 20, :]
    q, k, v = (t.requires_grad_() for t in (q, k, v))   # where fix "on" runs as itself (else as fix "off")
    o_off, o_on, o_paper = (kernels.flash_attention(q, k, v, fix=fix, numerics=Numerics(precision=precision))
                            for fix in ("off", "on", "paper"))
    ref, _ = reference(q, k, v, True)
    assert rel(o_paper, o_off) < 0.25 * rel(o_off, ref)   # the shift's rounding, well inside bf16's own error
    assert rel(o_paper, ref) < (2e-2 if precision == "autocast" else 5e-3)
    assert torch.equal(o_on, o_off)


def test_the_fix_is_on_by_default():
    """flash_attention is a drop-in that trains through: without a fix argument it runs the fix (fix "on": O and
    the gradients, bit for bit), not plain FlashAttention-2. Its emulation has no default: fix is its caller's."""
    q, k, v, do = (rand((1, 2, 100, 64)) for _ in range(4))
    attention = kernels.flash_attention
    on, off, default = (grads(attention, q, k, v, do, **fix) for fix in (dict(fix="on"), dict(fix="off"), {}))
    assert all(torch.equal(a, b) for a, b in zip(default, on))
    assert not all(torch.equal(a, b) for a, b in zip(default, off))
    with pytest.raises(TypeError, match="fix"):
        emulate.emulate_attention(q, k, v)


def structured(logit, n_tied, n=130, d=64, all_equal=False):
    """Rows whose max score is `logit` nats, reached by n_tied keys; the other keys sit 1-30 nats lower."""
    g = torch.Generator().manual_seed(n_tied)
    u = torch.zeros(d)
    u[0] = 1.0
    level = torch.rand(n, generator=g) * 29 + 1
    if all_equal:
        level.zero_()
    level[torch.randperm(n, generator=g)[:n_tied]] = 0.0
    scores = logit - level * math.copysign(1.0, logit) if logit else -level
    c = 64.0  # q = c * u and k_j = (score_j * sqrt(d) / c) * u give q.k / sqrt(d) = score_j
    q = (c * u).expand(1, 2, n, d).clone()
    k = (scores[:, None] * math.sqrt(d) / c * u).expand(1, 2, n, d).clone()
    v = torch.randn(1, 2, n, d, generator=g) - 0.5
    return tuple(t.to(torch.bfloat16).to(DEVICE) for t in (q, k, v))


@pytest.mark.parametrize("logit", [1e4, 300.0, 90.0, 1.0, 1e-3, 0.0, -1e-3, -90.0, -300.0, -1e4])
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
def test_paper_rule_adversarial_ties(logit, precision, poisoned):
    """The paper's rule at tied maxima of large and tiny logits of both signs, and all-equal rows: finite and close
    to float64, O and dV within 2e-2 (measured at most 5e-3 and 8e-3), dK within 0.1 (at most 5.6e-2, fix off's
    3e-2). Not dQ: its exact value is ~0 in these rows, so its relative error says nothing. (The official rule,
    beta * max, gives 0/0 once a tied max passes ~87 nats.)"""
    for n_tied, all_equal in ((2, False), (7, False), (130, True)):
        q, k, v = structured(logit, n_tied, all_equal=all_equal)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        o = kernels.flash_attention(q, k, v, causal=False, fix="paper", numerics=Numerics(precision=precision))
        o.backward(torch.ones_like(o))
        assert all(torch.isfinite(t).all() for t in (o, q.grad, k.grad, v.grad)), (logit, n_tied)
        ref, (_, k64, v64) = reference(q, k, v, False)
        ref.backward(torch.ones_like(ref))
        assert rel(o, ref) < 2e-2, (logit, n_tied, rel(o, ref))
        assert rel(v.grad, v64.grad) < 2e-2, (logit, n_tied, rel(v.grad, v64.grad))
        assert rel(k.grad, k64.grad) < 0.1, (logit, n_tied, rel(k.grad, k64.grad))


@requires_interpreter
def test_paper_rule_shift_stays_in_range_and_value_dependent():
    """The shift d = m' - r lies in [2^-6, 64) nats for every tied max, and depends on the max; a tile's max tied
    with an earlier tile's (t) counts as a tie, one 1 nat apart (below or above) does not, and a fully masked tile is
    left alone."""
    shift = lambda S, r, t: emulate.shifted_max(S, r, t, kernels.fix_constants("autocast"))  # noqa: E731
    r = torch.tensor([-1e4, -300.0, -87.0, -1.0, -1e-6, 0.0, 1e-6, 1e-3, 1.0, 63.0, 87.0, 300.0, 1e4])
    none = torch.full_like(r, -math.inf)                   # no earlier tile
    S = torch.stack([r, r, r - 5], -1)                     # two exact ties per row
    m, t = shift(S, r, none)
    d = m - r
    assert (d >= 2.0 ** -6 * 0.99).all() and (d < 64).all()
    assert len(set(d.tolist())) > len(r) // 2             # not a constant offset
    assert torch.equal(t, r)
    untied = torch.stack([r, r - 1, r - 5], -1)
    assert torch.equal(shift(untied, r, none)[0], r)
    assert torch.equal(shift(untied, r, r - 1)[0], r)
    assert torch.equal(shift(untied, r, r + 1)[0], r) and torch.equal(shift(untied, r, r + 1)[1], r + 1)
    assert torch.equal(shift(untied, r, r)[0], m)          # tied with the earlier tile: the same shift
    masked = torch.full((1, 3), -math.inf)
    assert shift(masked, masked.amax(-1), torch.zeros(1))[0] == -math.inf


@triton.jit
def _shifted_max_kernel(S, T, M, T_NEW, BLOCK: tl.constexpr, COLS: tl.constexpr, SHIFT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(S + rows[:, None] * COLS + tl.arange(0, COLS)[None, :])
    m, t_new = kernels._shifted_max(s, 1.0, tl.load(T + rows), SHIFT)   # S already scaled (the forward tests scale)
    tl.store(M + rows, m)
    tl.store(T_NEW + rows, t_new)


@requires_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in fmod")   # the -inf rows' d, never used
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
def test_shifted_max_equals_emulation_on_adversarial_rows(precision):
    """The kernel's _shifted_max, bit for bit against the emulation's, on rows of exact and near ties (within
    tol and just outside), maxima of 0, tiny, moderate, large (past 2^21 spans of the fold, ~10^8) and huge,
    of both signs, fully masked rows (-inf), and an earlier tiles' max t within tol of r and just outside, on
    either side, or far above it. (Interpreter only, as the file's other bitwise tests.)"""
    shift = kernels.fix_constants(precision)
    g = torch.Generator().manual_seed(1)
    rows = []
    for r in (0.0, 1e-30, 2.0 ** -12, 1e-3, 0.3, 1.0, 5.0, 63.0, 64.0, 90.0, 300.0, 1e4, 1e6, 1e8, 1e9, 1e20,
              3e37):
        for sign in (1.0, -1.0):
            for gap in (0.0, shift.tol / 2, shift.tol, shift.tol * 2, 1.0):
                row = r * sign - torch.rand(64, generator=g) * 20 - 2
                row[int(torch.randint(64, (1,), generator=g))] = r * sign
                row[int(torch.randint(64, (1,), generator=g))] = r * sign - gap
                rows.append(row)
    S = torch.cat([torch.stack(rows).float(), torch.full((3, 64), -math.inf),
                   torch.randn(1000, 64, generator=g) * 30])
    S = torch.cat([S, S.new_full((-len(S) % 64, 64), -1.0)])
    r = S.amax(-1)
    u, v = torch.rand(len(r), generator=g), torch.rand(len(r), generator=g)
    T = torch.where(u < 0.5, r + shift.tol * (4 * v - 2), torch.where(u < 0.7, r + 1 + 5 * v, -math.inf))
    above = T > r   # (rows where the earlier tiles' max is the larger: the new raw max is t, tied or not)
    assert (above & (T <= r + shift.tol)).any() and (T > r + shift.tol).any() and (T < r - shift.tol).any()
    m, t_new = torch.empty(len(S)), torch.empty(len(S))
    _shifted_max_kernel[(len(S) // 64,)](S, T, m, t_new, BLOCK=64, COLS=64, SHIFT=shift)
    m_want, t_want = emulate.shifted_max(S, r, T, shift)
    assert torch.equal(m.view(torch.int32), m_want.view(torch.int32)) and torch.equal(t_new, t_want)
    assert (m > r).sum() > len(S) // 10 and torch.equal(t_new[above], T[above])  # many rows were shifted


@triton.jit
def _round_bits_kernel(X, OUT, BLOCK: tl.constexpr, BITS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offs, kernels._round_bits(tl.load(X + offs), BITS))


@requires_interpreter
@pytest.mark.parametrize("bits", [1, 3, 7, 10])
def test_round_bits_is_ties_to_even(bits):
    """The amplifier's rounding in the kernel, on values exactly halfway between two neighbours (the last kept bit
    even and odd, both signs, exponents from 2^-90 to 2^100) and on random values: the nearer neighbour, ties to
    the even one, as float64 arithmetic rounds them, and bit for bit the host's round_mantissa (the emulation's)."""
    g = torch.Generator().manual_seed(bits)
    n = 512
    e = torch.randint(-90, 100, (n,), generator=g).double()
    kept = torch.randint(0, 2 ** bits, (n,), generator=g).double()      # the kept mantissa bits, below the tie
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    tie = sign * (1 + (kept + 0.5) / 2 ** bits) * 2.0 ** e            # bits + 1 fraction bits: exact in float32
    x = torch.cat([tie, torch.randn(n, generator=g).double() * 2.0 ** e]).float()
    assert torch.equal(x[:n].double(), tie) and (kept % 2 == 0).any() and (kept % 2 == 1).any()
    out = torch.empty_like(x)
    _round_bits_kernel[(len(x) // 256,)](x, out, BLOCK=256, BITS=bits)
    _, exponent = torch.frexp(x.double())                             # |x| in [2^(exponent-1), 2^exponent)
    unit = torch.ldexp(torch.ones_like(x, dtype=torch.float64), exponent - 1 - bits)   # the last kept bit's value
    want = (torch.round(x.double() / unit) * unit).float()            # torch.round: halves to even
    assert torch.equal(out, want) and torch.equal(out.view(torch.int32), round_mantissa(x, bits).view(torch.int32))
    assert torch.equal(out[:n].double().abs(), (1 + (kept + kept % 2) / 2 ** bits) * 2.0 ** e)   # ties: even


@triton.jit
def _fold_kernel(D, OUT, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + offs, kernels._fold(tl.load(D + offs), SHIFT))


@requires_interpreter
@pytest.mark.filterwarnings("ignore:invalid value encountered in fmod")   # d = inf, as in the kernel
@pytest.mark.parametrize("precision, p_bits", [("fa2", 0), ("autocast", 0), ("fa2", 1), ("autocast", 3)])
def test_fold_without_division_is_fmod(precision, p_bits):
    """_fold (lo + fmod(d, span) by a float64 floor, no division) against the emulation's lo + torch.fmod, bit for
    bit below 2^27 spans: at the multiples of span and the float32 values next to them, where the quotient is
    closest to an integer, and log-uniformly from 2^-40 to 2^40. Above, where the float64 quotient may be off by
    one, r + fold still rounds to what fmod's fold gives, for r = d and r = -d (beta 2)."""
    shift = kernels.fix_constants(precision, p_bits)
    span = torch.tensor(shift.span, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    k = torch.cat([torch.arange(1.0, 2049), 2.0 ** torch.arange(11, 28), torch.randint(1, 2 ** 27, (4000,),
                                                                                      generator=g).double()])
    multiples = (k.double() * span.double()).float()                   # k span, rounded to float32 when inexact
    near = torch.cat([multiples.view(torch.int32) + i for i in range(-3, 4)]).view(torch.float32)
    spread = 2.0 ** (torch.rand(20000, generator=g, dtype=torch.float64) * 80 - 40)
    edges = torch.tensor([0.0, -0.0, 1e-45, shift.lo, shift.hi, shift.span, 2 * shift.span, 2.0 ** 27 * shift.span])
    d = torch.cat([near, spread.float(), edges, edges.view(torch.int32).add(1).view(torch.float32)]).abs()
    exact = d < 2.0 ** 27 * span
    huge = 2.0 ** torch.linspace(35, 127.9, 4000, dtype=torch.float64)
    d = torch.cat([d[exact], huge.float(), (huge * 1.0001).float()])
    d = torch.cat([d, torch.full((-len(d) % 1024,), math.inf)])       # d = inf at the end: NaN, as fmod
    out = torch.empty_like(d)
    _fold_kernel[(len(d) // 1024,)](d, out, BLOCK=1024, SHIFT=shift)
    want = shift.lo + torch.fmod(d, shift.span)
    n, beyond = int(exact.sum()), (d >= 2.0 ** 27 * span) & (d < math.inf)
    assert torch.equal(out[:n].view(torch.int32), want[:n].view(torch.int32))
    assert beyond[n:].sum() == 2 * len(huge) and (out[beyond] != want[beyond]).any()   # the fold does differ
    for r in (d[beyond], -d[beyond]):                                 # but r + fold, its only use, does not
        assert torch.equal(r + out[beyond], r + want[beyond])
    assert out[d == math.inf].isnan().all() and want[d == math.inf].isnan().all()


# -------------------------------------------------------------------------------------------------------
# Bad input

def test_bad_input():
    q = rand((1, 2, 16, 64))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        kernels.flash_attention(q.float(), q.float(), q.float())
    with pytest.raises(TypeError, match="same dtype"):
        kernels.flash_attention(q, q, q.half())
    with pytest.raises(ValueError, match="same shape"):
        kernels.flash_attention(q, q[:, :, :8], q)
    with pytest.raises(ValueError, match="head_dim"):
        kernels.flash_attention(*(rand((1, 2, 16, 48)),) * 3)
    with pytest.raises(ValueError, match="shape"):
        kernels.flash_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="contiguous"):
        wide = rand((1, 2, 16, 128))[..., ::2]
        kernels.flash_attention(wide, wide, wide)
    for delta in ("p", "stochastic-o"):
        for attention in (kernels.flash_attention, emulate.emulate_attention):
            with pytest.raises(ValueError, match="choose one"):
                attention(q, q, q, fix="on", numerics=Numerics(delta=delta))
    for fix in (True, False, 1, None, "yes"):
        with pytest.raises(ValueError, match=re.escape(f'fix must be "off", "on" or "paper", got {fix!r}')):
            kernels.flash_attention(q, q, q, fix=fix)
    for numerics in (Numerics(stochastic_o="forward"), Numerics(delta="stochastic-o")):
        with pytest.raises(TypeError, match="bfloat16"):
            kernels.flash_attention(q.half(), q.half(), q.half(), fix="off", numerics=numerics)
    with pytest.raises(TypeError, match="torch.Tensor"):
        kernels.flash_attention(q.tolist(), q, q)
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):   # before the "vo" amplifier reads v
        kernels.flash_attention(q, q, q.tolist(), numerics=Numerics(mantissa_bits=3, amplify="vo"))
    with pytest.raises(TypeError, match=re.escape("q must be a dense (strided) tensor, got torch.sparse_coo")):
        kernels.flash_attention(*(q.to_sparse(),) * 3)
    for attention in (kernels.flash_attention, lambda *a, **kw: emulate.emulate_attention(*a, fix="on", **kw)):
        with pytest.raises(ValueError, match=re.escape("causal must be True or False (there is no mask argument), "
                                                       "got 'no'")):
            attention(q, q, q, causal="no")
        with pytest.raises(ValueError, match=re.escape("got a tensor of shape (16, 16)")):   # SDPA's attn_mask
            attention(q, q, q, torch.ones(16, 16, dtype=torch.bool).tril())
        with pytest.raises(TypeError, match="numerics must be a kernels.Numerics or None, got dict"):
            attention(q, q, q, numerics={"delta": "o"})
    for attention in (kernels.flash_attention, lambda *a: emulate.emulate_attention(*a, fix="off")):
        for empty in ((1, 2, 0, 16), (0, 2, 8, 16), (1, 0, 8, 16)):   # an empty O returned, or a crash in backward
            with pytest.raises(ValueError, match=re.escape(f"batch, heads and seq must be at least 1, got {empty}")):
                attention(*(torch.zeros(empty, dtype=torch.bfloat16, device=DEVICE),) * 3)
        with pytest.raises(ValueError, match=re.escape(f"q, k, v must be on the same device, got {q.device}, meta, "
                                                       f"{q.device}")):   # (a CPU tensor beside CUDA ones, say)
            attention(q, q.to("meta"), q)
    for attention in (kernels.flash_attention, emulate.emulate_attention):
        with pytest.raises(TypeError, match=re.escape('fix="paper" shifts a tied row\'s max up by as much as 64 '
                                                      "nats, where P underflows torch.float16: give bfloat16")):
            attention(q.half(), q.half(), q.half(), fix="paper")


def test_bfloat16_on_a_gpu_without_it_is_refused(monkeypatch):
    """A T4 (compute capability 7.5) has no bfloat16: one line, before a launch Triton could not compile; the
    emulation, which Triton does not compile, runs."""
    q = rand((1, 2, 16, 64))
    monkeypatch.setattr(kernels, "capability", lambda device: (7, 5))
    with pytest.raises(TypeError, match=re.escape("bfloat16 needs a GPU of compute capability 8.0 or later (an "
                                                  f"A100, RTX 30xx, L4, H100); {q.device} has 7.5")):
        kernels.flash_attention(q, q, q, fix="on")
    assert kernels.flash_attention(q.half(), q.half(), q.half()).dtype == torch.float16   # float16 is not refused
    assert emulate.emulate_attention(q, q, q, fix="on").isfinite().all()


@requires_interpreter
def test_what_the_kernels_grid_and_offsets_cannot_hold_is_refused():
    """batch * heads past CUDA's 65,535 programs in the grid's second dimension, and a head's rows past 2^31
    elements (the kernel's row offsets are int32), in one line each; up to either limit the checks pass. Shapes
    on the meta device: nothing is allocated."""
    meta = lambda *shape: torch.empty(shape, dtype=torch.float16, device="meta")
    q = meta(65_536, 1, 4, 16)
    with pytest.raises(ValueError, match=re.escape("batch * heads must be at most 65,535, the kernel's grid, got "
                                                   "65536 * 1 = 65536")):
        kernels.flash_attention(q, q, q)
    q = meta(2 ** 25 + 1, 64)[None, None]                   # the last row's last element at 2^31 + 63
    with pytest.raises(ValueError, match=re.escape("q's 33,554,433 rows, 64 elements apart, reach past 2^31 "
                                                   "elements within a head")):
        kernels.flash_attention(q, q, q)
    heads = meta(1, 2 ** 20 + 1, 3 * 2048).view(1, 2 ** 20 + 1, 3, 32, 64)   # a GPT's q, k, v head views
    q, k, v = (heads[:, :, i].transpose(1, 2) for i in range(3))
    with pytest.raises(ValueError, match=re.escape("q's 1,048,577 rows, 6,144 elements apart")):
        kernels.flash_attention(q, k, v)
    shared = meta(1, 1, 2 ** 20 + 1, 64).expand(1, 32, -1, -1)   # one head's rows for all: O's are 32 * 64 apart
    with pytest.raises(ValueError, match=re.escape("O's 1,048,577 rows, 2,048 elements apart")):
        kernels.flash_attention(shared, shared, shared)
    kernels.check_launch(meta(65_535, 1, 4, 16), *[meta(1, 1, 4, 16)] * 2)
    kernels.check_launch(*[meta(2 ** 25, 64)[None, None]] * 3)   # the last element at 2^31 - 1


def test_cpu_tensors_without_interpreter(monkeypatch):
    monkeypatch.setattr(kernels, "INTERPRET", False)
    q = torch.randn(1, 1, 8, 16).bfloat16()
    for fn in (kernels.flash_attention, kernels.forward):
        with pytest.raises(ValueError, match=r"needs CUDA tensors, got cpu; on the CPU use torch's "
                                             r"scaled_dot_product_attention, or in nanolp nanolp\.emulate"):
            fn(q, q, q, fix="on")


def test_tensors_without_data_are_refused(monkeypatch):
    """meta tensors (a shape, no data): one line, compiled or under the interpreter, which would otherwise fail deep
    in Triton as it copies their data."""
    q = torch.empty(1, 1, 8, 16, dtype=torch.bfloat16, device="meta")
    for interpret, line in ((True, "Triton's CPU interpreter reads the tensors' data, which meta tensors do not hold"),
                            (False, "the kernel needs CUDA tensors, got meta")):
        monkeypatch.setattr(kernels, "INTERPRET", interpret)
        with pytest.raises(ValueError, match=re.escape(line)):
            kernels.flash_attention(q, q, q)


def test_stock_interpreter_is_refused(monkeypatch):
    """Triton's interpreter without nanolp/interp_patch.py returns bf16 results wrong by orders of magnitude, finite
    and silent: the kernel refuses to run under it rather than return them."""
    from triton.runtime import interpreter
    monkeypatch.setattr(kernels, "INTERPRET", True)
    monkeypatch.delattr(interpreter, "nanolp_bf16_patch", raising=False)   # as before the patch
    q = torch.randn(1, 1, 8, 16).bfloat16()
    for fn in (kernels.flash_attention, kernels.forward):
        with pytest.raises(ValueError, match=r"interpreter computes bf16 wrongly unless nanolp/interp_patch\.py "
                                             r"patches it; on the CPU use torch's scaled_dot_product_attention, "
                                             r"or in nanolp nanolp\.emulate\.emulate_attention"):
            fn(q, q, q, fix="on")


def compile_launches(*argv):
    """nanolp/compile_sm90.py with these arguments, in a process without the interpreter."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "nanolp.compile_sm90", *argv], cwd=Path(__file__).resolve().parents[1],
                          env=env, capture_output=True, text=True, timeout=1200)


def test_the_compile_check_under_the_interpreter_is_one_line():
    """TRITON_INTERPRET exported (as the CPU tests run): the compile check says to unset it, in one line."""
    done = subprocess.run([sys.executable, "-m", "nanolp.compile_sm90", "--arch", "86"], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
                          timeout=300)
    assert done.returncode == 1 and done.stderr == "nanolp.compile_sm90: run it without TRITON_INTERPRET (unset it): " \
        "it compiles the kernels, the interpreter runs them\n"


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the other tests compile what they run")
def test_every_specialization_compiles_for_sm90():
    """The interpreter runs code Triton's compiler rejects (a loop-carried value changing dtype passes every test
    above); nanolp/compile_sm90.py compiles each launch the host code makes for the H200, in a process without the
    interpreter, and each must fit the shared memory a block may have there. ~1 minute (less with Triton's cache)."""
    done = compile_launches()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compile for sm_90" in done.stdout


@pytest.mark.skipif(not INTERPRETED, reason="on a GPU the other tests compile what they run")
@pytest.mark.parametrize("arch", [80, 86, 89])
def test_each_tuning_fits_the_shared_memory_of(arch):
    """The tuning was chosen on sm_90: compiled for an A100 (80), an RTX 3090 or A10 (86), an RTX 4090, L4 or L40
    (89), each head_dim's launches (compile_sm90.py --tunings: forward with fix off and on, backward with delta
    from O and from the fp32 O, short and long) must fit the shared memory a block may have there (SHARED_LIMIT),
    or the launch fails on that GPU (head_dim 128's forward takes a stage fewer on 86 and 89: kernels.SMALL_SHARED).
    ~40 s each (less with Triton's cache)."""
    done = compile_launches("--arch", str(arch), "--tunings")
    if f"compile for sm_{arch}" not in done.stdout:
        raise RuntimeError(f"does not compile for sm_{arch}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("seq_major", [True, False])
def test_outputs_and_gradients_keep_the_inputs_layout(seq_major, poisoned):
    check_keeps_layout(seq_major, kernels.flash_attention)


def check_keeps_layout(seq_major, attention):
    """q, k, v viewed from (B, T, H, D) storage, as a GPT produces them, or plain (B, H, T, D): O, dQ, dK, dV come
    back in the same layout (so the model's reshape to (B, T, C) is free) with the right values, also for a dO
    in another layout and for an expanded one (the gradient of a sum). attention: the one-pass backward's test
    passes its own (tests/test_launch_variants.py)."""
    def inputs(seed):
        t = rand((2, 70, 3, 32), seed=seed).transpose(1, 2) if seq_major else rand((2, 3, 70, 32), seed=seed)
        return t.requires_grad_()
    q, k, v = inputs(0), inputs(1), inputs(2)
    o = attention(q, k, v, fix="off")
    assert o.transpose(1, 2).is_contiguous() == seq_major and o.is_contiguous() == (not seq_major)
    do = rand((2, 3, 70, 32), seed=3)
    o.backward(do if seq_major else do.transpose(1, 2).contiguous().transpose(1, 2))  # dO in the other layout
    ref, leaves = reference(q, k, v, True)
    ref.backward(do.double())
    assert rel(o, ref) < 5e-3
    for t, r in zip((q, k, v), leaves):
        assert t.grad.stride() == o.stride() and rel(t.grad, r.grad) < 1e-2
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    attention(q2, k2, v2, fix="off").float().sum().backward()  # dO: stride 0
    ref2, leaves2 = reference(q2, k2, v2, True)
    ref2.sum().backward()
    for t, r in zip((q2, k2, v2), leaves2):
        assert rel(t.grad, r.grad) < 1e-2


@pytest.mark.parametrize("seq_major", [True, False])
@pytest.mark.parametrize("delta, stochastic", [("o", False), ("fp32-o", False), ("stochastic-o", False),
                                               ("o", True), ("fp32-o", True)])
def test_custom_ops_pass_torch_opcheck(seq_major, delta, stochastic):
    """torch's own check of a custom op: schema, autograd registration, and fake (meta) outputs whose shapes,
    strides and dtypes match the real ones, which torch.compile relies on."""
    q, k, v = (rand((1, 20, 2, 16), seed=s).transpose(1, 2) if seq_major else rand((1, 2, 20, 16), seed=s)
               for s in range(3))
    fwd_args = (q, k, v, True, "paper", delta, "fa2", 0, 0, stochastic, True)
    if stochastic or delta == "stochastic-o":   # opcheck compares two calls: the same draws each time
        torch.library.opcheck(kernels.flash_fwd_op, fwd_args, test_utils=("test_schema", "test_faketensor",
                                                                          "test_autograd_registration"))
        return
    torch.library.opcheck(kernels.flash_fwd_op, fwd_args)
    o, lse, *_ = kernels.flash_fwd_op(*fwd_args)
    torch.library.opcheck(kernels.flash_bwd_op, (rand(o.shape, seed=3), q, k, v, o, lse, True, "fa2", False, True))


def test_eager_calls_run_the_ops_functions(monkeypatch):
    """An eager call skips the custom ops' dispatch (kernels.direct), which cost more host time than the kernels
    take at seq 256 (results/speed/host_path); only O is differentiable, so no zero gradients are made for lse and
    the fp32 O. torch.compile still goes through the ops (the test below)."""
    def dispatched(*args):
        raise AssertionError("an eager call went through the op's dispatch")
    monkeypatch.setattr(kernels, "flash_fwd_op", dispatched)
    monkeypatch.setattr(kernels, "flash_bwd_op", dispatched)
    q, k, v = (rand((1, 2, 70, 32), seed=s).requires_grad_() for s in range(3))
    out = kernels.forward(q, k, v, fix="on")
    assert out.o.requires_grad and not out.lse.requires_grad and not out.o_delta.requires_grad
    out.o.float().square().sum().backward()
    assert all(t.grad is not None and t.grad.isfinite().all() for t in (q, k, v))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")   # (its third case's)
def test_a_double_backward_is_refused():
    """The backward is not itself differentiable: a gradient asked for with create_graph=True, a second derivative
    to follow, is refused in one line, through q or around attention (a residual) alike, where its second
    derivative would miss attention's terms silently; torch.compile still traces the backward whole."""
    q, k, v = (rand((1, 2, 40, 16), seed=s).requires_grad_() for s in range(3))
    once = "^flash_attention is differentiable once: its backward cannot build a graph for a second derivative"
    with pytest.raises(RuntimeError, match=once):
        torch.autograd.grad(kernels.flash_attention(q, k, v).float().square().sum(), q, create_graph=True)
    x = q.detach().clone().requires_grad_()
    with pytest.raises(RuntimeError, match=once):
        torch.autograd.grad((kernels.flash_attention(x, k, v) + x).float().square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=once):
        (kernels.flash_attention(x, k, v) + x).float().square().sum().backward(create_graph=True, inputs=[x])
    f = lambda q, k, v: kernels.flash_attention(q, k, v).float().square().sum()
    f(q, k, v).backward()
    eager = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch._dynamo.reset()
    torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v).backward()
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), eager))


@pytest.mark.parametrize("amplify, delta", [("p", "o"), ("vo", "o"), ("p", "fp32-o")])
def test_torch_compile_traces_through_the_op(amplify, delta):
    """train.py compiles the model: the custom ops' fake implementations must accept exactly what the ops do,
    or dynamo logs an error, breaks the graph and runs that part eagerly (at half the speed, silently)."""
    q, k, v = (rand((1, 2, 70, 32), seed=s).requires_grad_() for s in range(3))
    numerics = Numerics(mantissa_bits=3, amplify=amplify, delta=delta)
    def f(q, k, v):
        return kernels.flash_attention(q, k, v, fix="on", numerics=numerics)
    torch._dynamo.reset()
    o = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    o.float().square().sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_eager = f(*eager)
    o_eager.float().square().sum().backward()
    assert torch.equal(o, o_eager)
    for a, b in zip((q, k, v), eager):
        assert torch.equal(a.grad, b.grad)


# -------------------------------------------------------------------------------------------------------
# The single file

@pytest.mark.skipif(not INTERPRETED, reason="the interpreter run is the CPU's; a GPU runs kernels.py in every test")
def test_kernels_py_runs_copied_alone(tmp_path):
    """kernels.py imports only the standard library, torch and triton: copied alone into an empty folder it runs a
    forward and a backward (under the interpreter, patched by nanolp/interp_patch.py loaded from its path, so that
    nothing of the project is importable there) and gives this checkout's bits."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "kernels.py").write_bytes((root / "kernels.py").read_bytes())
    script = f"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("patch", {str(root / "nanolp" / "interp_patch.py")!r})
patch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(patch)
patch.apply()
import torch
import kernels
assert not any(name.split(".")[0] in ("nanolp", "model", "experiments") for name in sys.modules), sorted(sys.modules)
g = torch.Generator().manual_seed(0)
q, k, v, do = (torch.randn(1, 2, 70, 32, generator=g).bfloat16() for _ in range(4))
q, k, v = (t.requires_grad_() for t in (q, k, v))
o = kernels.flash_attention(q, k, v, causal=True)
o.backward(do)
torch.save([t.detach() for t in (o, q.grad, k.grad, v.grad)], "out.pt")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTHONPATH", None)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 70, 32, generator=g).bfloat16() for _ in range(4))
    want = (kernels.flash_attention(q, k, v), *grads(kernels.flash_attention, q, k, v, do))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
