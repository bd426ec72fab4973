"""The one-pass backward (experiments/launch_variants.py): dQ summed over key tiles by fp32 atomics in the
dK/dV pass, or by TMA reductions (DQ_TMA, the interpreter's through nanolp/interp_patch.py), against the
emulation of its order, the two-pass backward and float64; tuned's settings; the persistent forward and the
forward with score tiles of 128 keys against kernels.py's. Runs where tests/test_kernels.py does (the
interpreter on the CPU, the compiled kernel on a GPU)."""
import pytest
import torch

import kernels
from experiments import launch_variants
from experiments.launch_variants import ONE_PASS_TUNING, one_pass_attention, persistent, persistent_attention
from nanolp.numerics import Numerics
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


@requires_interpreter
@pytest.mark.parametrize("fix", ["off", "on"])
@pytest.mark.parametrize("causal", [True, False])
def test_persistent_forward_bitwise_equal_kernels(causal, fix, poisoned):
    """The persistent forward's O, lse and fp32 O (fix "on"), bit for bit kernels.py's, at lengths from one query
    to a ragged third tile, on one program (it loops over every work item), three (each loops over several, in
    both directions) and more programs than work items; every element written (the buffers start as NaN)."""
    for (B, H, N), programs in [((1, 1, 1), 3), ((1, 2, 100), 3), ((2, 3, 200), 3), ((1, 1, 333), 1),
                                ((2, 1, 100), 50)]:
        q, k, v = rand((B, H, N, 32), scale=2.0), rand((B, H, N, 32)), rand((B, H, N, 32))
        k[..., N // 2, :] = k[..., N // 3, :]                       # exact ties, so the shift has work to do
        want = kernels.forward(q, k, v, causal=causal, fix=fix)
        with persistent(programs):
            ours = kernels.forward(q, k, v, causal=causal, fix=fix)
        for name, a, b in zip(want._fields, ours, want):
            assert a.dtype == b.dtype and torch.equal(a, b), f"{(B, H, N)}, {programs} programs: {name} differs"


@requires_interpreter
@pytest.mark.parametrize("fix", ["off", "on"])
def test_persistent_attention_gradients_equal_kernels(fix, poisoned):
    """persistent_attention's O and gradients are flash_attention's bits: the same forward, the same backward."""
    shape = (1, 2, 130, 32)
    q, k, v, do = rand(shape, scale=2.0), rand(shape), rand(shape), rand(shape)
    ours = grads(persistent_attention, q, k, v, do, fix=fix, programs=3)
    want = grads(kernels.flash_attention, q, k, v, do, fix=fix)
    for name, a, b in zip(("dQ", "dK", "dV"), ours, want):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"{name} differs"


def test_persistent_grid_holds_what_the_gpu_runs_at_once(monkeypatch):
    """Without a program count the persistent forward launches SMs x PERSISTENT_TUNING's programs per SM
    (STAND_IN_SMS off a GPU, the GPU's own count on one), never more than its work items, with its register cap;
    kernels._fwd_kernel is restored after."""
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append((grid, meta.get("maxnreg")))
    kernel = kernels._fwd_kernel
    monkeypatch.setattr(launch_variants, "_fwd_persistent_kernel", Recorder())
    q = torch.zeros(1, 1, 1, 64)
    with persistent():
        kernels._fwd_kernel[(64, 16)](q, HEAD_DIM=64)
        kernels._fwd_kernel[(2, 3)](q, HEAD_DIM=64)
    programs, maxnreg = launch_variants.PERSISTENT_TUNING[64]
    assert launches == [((launch_variants.STAND_IN_SMS * programs,), maxnreg), ((6,), maxnreg)]
    assert kernels._fwd_kernel is kernel
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"multi_processor_count": 7}))
    programs = launch_variants.PERSISTENT_TUNING[128][0]
    assert launch_variants.resident_programs(torch.device("cuda", 0), 128) == 7 * programs


# Score tiles of 128 keys (launch_variants.wide): the same bits as kernels.py's forward, run where the tests run

def forward_bits(q, k, v, causal, fix, precision):
    """O, lse and the fp32 O (delta "fp32-o", whatever the fix) of kernels.py's forward as launched now."""
    return kernels.forward(q, k, v, causal=causal, fix=fix, numerics=Numerics(precision=precision), delta="fp32-o")


def assert_same_bits(ours, want, where):
    for name, a, b in zip(("O", "lse", "fp32 O"), ours, want):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {name} differs from kernels.py's forward"


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("fix", ["off", "paper", "on"])
@pytest.mark.parametrize("causal", [True, False])
def test_wide_forward_bitwise_equals_kernels(causal, fix, precision):
    """O, lse and the fp32 O with S computed 128 keys at a time, bit for bit kernels.py's (so the emulation's),
    at lengths from one key to an odd number of 64-key tiles with a ragged last one: pairs, an odd unmasked tile
    (non-causal, or causal with the interpreter's query tiles of 64), the masked tiles."""
    for N in (1, 64, 100, 200, 300, 513):
        q, k, v = rand((1, 1, N, 32), scale=2.0), rand((1, 1, N, 32)), rand((1, 1, N, 32))
        k[..., N // 2, :] = k[..., N // 3, :]                     # a tied max, for the shift
        with launch_variants.wide():
            ours = forward_bits(q, k, v, causal, fix, precision)
        assert_same_bits(ours, forward_bits(q, k, v, causal, fix, precision), f"N={N}")


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("precision", ["fa2", "autocast"])
@pytest.mark.parametrize("causal", [True, False])
def test_wide_forward_ties_across_the_halves(causal, precision):
    """Keys 64-127 a copy of keys 0-63, so every row's max over a pair appears in both halves: the shift's tie
    test must see the second half's as a tie across tiles, as kernels.py does (same bits), not as a tie within
    one tile of 128 (a forward with 128-key tiles, tuned(block_n=128), gives other bits here). Query tiles of
    128, the GPU's, so causal rows also see whole pairs."""
    N, D = 300, 32
    q, k, v = rand((1, 2, N, D), scale=2.0), rand((1, 2, N, D)), rand((1, 2, N, D))
    k[..., 64:128, :] = k[..., 0:64, :]
    k[..., 192:256, :] = k[..., 128:192, :]
    with launch_variants.tuned(fwd={D: (128, 4, 1)}):
        with launch_variants.wide():
            ours = forward_bits(q, k, v, causal, "on", precision)
        assert_same_bits(ours, forward_bits(q, k, v, causal, "on", precision), "ties across the halves")
        with launch_variants.tuned(block_n=128):
            one_tile = forward_bits(q, k, v, causal, "on", precision)
    assert not all(torch.equal(a, b) for a, b in zip(ours, one_tile)), "the ties did not reach the shift"


@requires_interpreter
def test_wide_forward_computes_128_scores_at_a_time(monkeypatch):
    """The wide forward's unmasked loop computes S for 128 keys per product (launch_variants._scores); the
    masked tiles and an odd last tile go through kernels.py's loop (kernels._scores), and kernels.py's own
    forward is left as it was."""
    widths = []
    monkeypatch.setattr(launch_variants, "_scores", lambda q, kT, *args: widths.append(int(kT.shape[1])) or
                        kernels._scores(q, kT, *args))
    q = rand((1, 1, 200, 32))
    kernel = kernels._fwd_kernel
    with launch_variants.wide():
        assert kernels._fwd_kernel is not kernel
        kernels.forward(q, q, q, causal=False, fix="on")
    assert kernels._fwd_kernel is kernel
    assert widths == [128] * 4                    # 4 query tiles of 64, each 1 pair of its 3 unmasked key tiles
