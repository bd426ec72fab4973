"""The one-pass backward (experiments/launch_variants.py): dQ summed over key tiles by fp32 atomics in the
dK/dV pass, or by TMA reductions (DQ_TMA, the interpreter's through nanolp/interp_patch.py), against the
emulation of its order, the two-pass backward and float64; and tuned's settings. Runs where tests/test_kernels.py
does (the interpreter on the CPU, the compiled kernel on a GPU)."""
import pytest
import torch

import kernels
from experiments import launch_variants
from experiments.launch_variants import ONE_PASS_TUNING, one_pass_attention
from kernels import Numerics
from nanolp import emulate
from tests.test_kernels import (DELTAS, INTERPRETED, check_against_float64, check_keeps_layout, grads,  # noqa: F401
                                poisoned, rand, requires_interpreter, _seed_inputs)


@pytest.fixture(params=[False, True], ids=["atomics", "tma"])
def dq_tma(request, monkeypatch):
    """The one-pass backward's dQ added by fp32 atomics, then by TMA reductions (DQ_TMA)."""
    monkeypatch.setattr(launch_variants, "DQ_TMA", request.param)
    return request.param


def test_dq_by_tma_where_the_gpu_has_it(monkeypatch):
    """By default (DQ_TMA None) the one-pass backward adds dQ by TMA only on a GPU of compute capability 9.0
    or later, by atomics elsewhere (the CPU here, older GPUs); a set DQ_TMA holds on any device."""
    monkeypatch.setattr(launch_variants, "DQ_TMA", None)
    assert launch_variants.dq_by_tma(torch.device("cpu")) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert launch_variants.dq_by_tma(torch.device("cuda", 0)) is False
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert launch_variants.dq_by_tma(torch.device("cuda", 0)) is True
    for setting in (False, True):
        monkeypatch.setattr(launch_variants, "DQ_TMA", setting)
        assert launch_variants.dq_by_tma(torch.device("cuda", 0)) is setting
        assert launch_variants.dq_by_tma(torch.device("cpu")) is setting


@requires_interpreter
@pytest.mark.parametrize("shape", [(1, 2, 130, 64), (2, 1, 77, 32)])
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("fix", ["off", "on"])
@pytest.mark.parametrize("causal", [True, False])
def test_one_pass_gradients_bitwise_equal_emulation(shape, precision, fix, causal, dq_tma, poisoned):
    """dQ, dK, dV of the one-pass backward, bit for bit against the emulation of its summation order
    (emulate._dq_one_pass), at lengths that leave a ragged last tile, with the fix on and off, with dQ by
    atomics and by TMA reductions."""
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    k[..., 5, :] = k[..., 3, :]                                   # exact ties, so the shift has work to do
    numerics = Numerics(precision=precision)
    ours = grads(one_pass_attention, q, k, v, do, causal=causal, fix=fix, numerics=numerics)
    want = grads(emulate.emulate_attention, q, k, v, do, causal=causal, fix=fix, numerics=numerics,
                 one_pass=ONE_PASS_TUNING[shape[-1]][:2])
    for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
        assert a.dtype == q.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16)), \
            f"{name} differs from the emulation"


@requires_interpreter
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_one_pass_gradients_bitwise_equal_emulation_at_every_tuning(D, dq_tma, poisoned):
    """Each head_dim's one-pass tiles as the GPU runs them (ONE_PASS_TUNING; the interpreter keeps them: 64
    queries x 128 keys at d128), bit for bit against the emulation in both precisions, at a length with three
    key tiles of 128, the last one ragged, with dQ by atomics and by TMA reductions."""
    shape = (1, 2, 300, D)
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    for precision in ("fa2", "autocast"):
        numerics = Numerics(precision=precision)
        ours = grads(one_pass_attention, q, k, v, do, fix="off", numerics=numerics)
        want = grads(emulate.emulate_attention, q, k, v, do, fix="off", numerics=numerics,
                     one_pass=ONE_PASS_TUNING[D][:2])
        for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{precision}: {name} differs"


@requires_interpreter
@pytest.mark.parametrize("delta_from", list(DELTAS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_pass_equals_two_pass_under_the_interpreter(delta_from, dtype, poisoned):
    """The interpreter runs the programs in launch order, key tile 0 first, so the atomics add each dQ_i's
    key-tile shares in ascending order from zero: the dQ kernel's order. So there, at a head_dim where the two
    backwards have the same tiles, the one-pass backward gives the two-pass one's bits, with delta from O, from
    P and from the fp32 O, in bf16 and fp16."""
    shape = (1, 2, 200, 64)                                       # 4 key tiles, the last one ragged
    assert ONE_PASS_TUNING[64][:2] == kernels.BWD_TUNING[64][:2]
    q, k, v, do = rand(shape, dtype, 2.0), rand(shape, dtype), rand(shape, dtype), rand(shape, dtype)
    one = grads(one_pass_attention, q, k, v, do, fix="off", numerics=DELTAS[delta_from])
    two = grads(kernels.flash_attention, q, k, v, do, fix="off", numerics=DELTAS[delta_from])
    for name, a, b in zip(("dQ", "dK", "dV"), one, two):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name}: one pass differs from two"


@requires_interpreter
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("D", [64, 128])
def test_one_pass_fp32_sum_follows_the_emulated_order(D, causal, precision, dq_tma):
    """The fp32 buffer the atomics (or TMA reductions) fill, before its cast (where a difference of order is
    seen at all: it rarely tips dQ's rounding to bf16), bit for bit against emulate._dq_one_pass and the sum
    over the key tiles in ascending order (the dQ kernel's order, at the one-pass backward's tiles: 128 keys at
    d128); and the order decides those bits: the same shares summed from the last key tile down differ."""
    shape = (1, 2, 300, D)                                        # at least 3 key tiles, the last one ragged
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    o, lse, _ = kernels.forward(q, k, v, causal=causal, fix="off", numerics=Numerics(precision=precision))
    (_, per_key), strides, meta = launch_variants.one_pass_launch(q, k, v, o, causal, precision, True)
    args = (q, k, v, do, lse, kernels.bwd_delta(do, q, k, v, o, lse, causal, precision, False, True))
    dq_sum, dk, dv = torch.zeros_like(o, dtype=torch.float32), torch.empty_like(o), torch.empty_like(o)
    target = launch_variants.dq_sum_target(dq_sum, meta["BLOCK_M"], dq_tma)
    launch_variants._bwd_dkdv_dq_kernel[per_key](*args, dk, dv, target, *strides, 1.0, DQ_TMA=dq_tma, **meta)
    P, dP = emulate._probs_and_dp(q, k, v, lse, do, causal, precision)
    delta = emulate.delta(q, k, v, o, lse, do, causal, precision)
    dS = emulate._round(P * (dP - delta.unsqueeze(-1)), q.dtype)
    tiles = emulate._tiles(shape[-2], meta["BLOCK_N"])
    assert torch.equal(dq_sum, emulate._dq_one_pass(dS, k, meta["BLOCK_M"], meta["BLOCK_N"]))
    assert torch.equal(dq_sum, sum(emulate._dot(dS[..., c], k[..., c, :]) for c in tiles))
    assert not torch.equal(dq_sum, sum(emulate._dot(dS[..., c], k[..., c, :]) for c in reversed(tiles)))


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_gradients_against_float64(seed, dq_tma, poisoned):
    """Within twice plain bf16 attention's error of float64, at every head_dim, in bf16 and fp16, causal or
    not, with the fix on and off, dQ by atomics and by TMA reductions; on a GPU this is the one-pass
    backward's correctness test."""
    g = torch.Generator().manual_seed(100 + seed)
    B, H = (int(x) for x in torch.randint(1, 3, (2,), generator=g))
    N = int(torch.randint(60, 200, (1,), generator=g))
    D = [16, 32, 64, 128][seed % 4]
    dtype = [torch.bfloat16, torch.float16][seed % 2]
    q, k, v = (rand((B, H, N, D), dtype, seed=seed * 3 + i) for i in range(3))
    check_against_float64(q, k, v, seed % 3 != 0, fix="on" if seed % 2 == 0 else "off",
                          attention=one_pass_attention)


@pytest.mark.skipif(INTERPRETED, reason="the interpreter runs every setting unpipelined; this is for the GPU's")
@pytest.mark.parametrize("N", [kernels.SHORT_SEQ, kernels.SHORT_SEQ + 77])
@pytest.mark.parametrize("D", [16, 32, 64, 128])
def test_one_pass_gradients_every_tuning_setting(N, D, dq_tma, poisoned):
    """Each head_dim's one-pass settings (ONE_PASS_TUNING; stages differ across SHORT_SEQ), dQ by atomics and by
    TMA reductions."""
    q, k, v = (rand((1, 2, N, D), seed=D + i) for i in range(3))
    check_against_float64(q, k, v, True, attention=one_pass_attention)


@pytest.mark.parametrize("seq_major", [True, False])
def test_one_pass_keeps_the_inputs_layout(seq_major, dq_tma, poisoned):
    """tests/test_kernels.py's layout test for the one-pass backward; with TMA, the descriptor of its dQ buffer
    too (seq-major, its strides are not in descending order)."""
    check_keeps_layout(seq_major, one_pass_attention)
