"""nanolp/diagnostics.py on a small model: the log's columns, the attention statistics (tie, sharp and push rates)
on inputs built to have a known answer, and the delta probe (the error delta reads in one layer, split by the
curvature hypothesis)."""
import math

import pytest
import torch

from model import GPT, GPTConfig, reference_attention
from nanolp import diagnostics
from nanolp.diagnostics import (PROBE_LAYER, _probe_pass, attention_stats, delta_probe, diag_columns, diagnose,
                                fp32_output, mean_and_se, probe_columns)
from nanolp.emulate import causal_scores

SMALL = dict(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64)
BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def tiny(attn="emulate", **config):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL, attn=attn, fix="off", **config))


def batches(n=2, B=4):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(65, (B, 64), generator=g), torch.randint(65, (B, 64), generator=g)) for _ in range(n)]


def qkv(logit_scale=1.0, B=2, H=2, T=64, D=32):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    return (q * logit_scale).bfloat16(), k.bfloat16(), v.bfloat16()


def test_probe_columns_are_finite_repeatable_and_leave_the_gradients_alone():
    model = tiny()
    out = delta_probe(model, batches(), BF16)
    assert sorted(out) == sorted(probe_columns())
    assert all(math.isfinite(v) for v in out.values())
    assert all(out[c] > 0 for c in out if c.endswith(f"_se_L{PROBE_LAYER}"))
    assert {k: v.item() for k, v in delta_probe(model, batches(), BF16).items()} == {k: v.item() for k, v in out.items()}
    assert all(p.grad is None for p in model.parameters())


def test_the_seed_redraws_only_the_probes_noise():
    """train.py seeds the probe with the step: another seed draws other noise for curv and indep, and leaves every
    column that reads no noise as it was."""
    model = tiny()
    x, y = batches(1, B=2)[0]
    a, b = diagnose(model, x, y, BF16, seed=1000), diagnose(model, x, y, BF16, seed=2000)
    noisy = {c for c in a if c.startswith(("probe_curv", "probe_indep"))}
    assert {c for c in a if a[c] != b[c]} <= noisy
    assert a["probe_indep_L0"] != b["probe_indep_L0"] and a["probe_curv_L0"] != b["probe_curv_L0"]
    assert diagnose(model, x, y, BF16, seed=1000) == a


def test_the_clean_pass_feeds_the_fp32_o_downstream():
    """The probe's clean pass replaces the layer's O by the fp32 O and runs its output projection in fp32: the
    gradient it returns differs from the rounded pass's, and feeding the rounded O back in through the same path
    gives the rounded pass's gradient to fp32 accuracy (so the difference is O's rounding, not the path)."""
    model = tiny()
    x, y = batches(1)[0]
    (q, k, v, O), dO = _probe_pass(model, x, y, BF16, PROBE_LAYER)
    o32 = fp32_output(q, k, v, model.config).float()
    _, dO_clean = _probe_pass(model, x, y, BF16, PROBE_LAYER, replace=o32.clone())
    _, dO_same = _probe_pass(model, x, y, BF16, PROBE_LAYER, replace=O.float().clone())
    assert not torch.equal(O.float(), o32)
    assert not torch.equal(dO_clean, dO_same)                     # the same path: only the O it is fed differs
    assert (dO_same - dO).abs().max() <= 1e-2 * dO.abs().max()   # bf16 weights vs fp32 weights in the projection


def test_without_positions_repeated_tokens_tie_exactly():
    """--pos none: layer 0 sees tokens only, so a row's best key ties exactly with every repeat of its token.
    With 4 symbols nearly every row repeats its best token; with learned positions the copies differ (the
    near-ties left at init come from scores still close to 0)."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(4, (2, 64), generator=g), torch.randint(4, (2, 64), generator=g)
    rates, sizes = {}, {}
    for pos in ("learned", "none"):
        model = tiny(pos=pos)
        rates[pos] = diagnose(model, x, y, BF16)["tie_rate_L0"]
        sizes[pos] = sum(p.numel() for p in model.parameters())
    assert rates["none"] > 0.8 and rates["learned"] < 0.2, rates   # at init: 0.90 and 0.13
    assert sizes["learned"] - sizes["none"] == SMALL["block_size"] * SMALL["n_embd"]


def test_diagnostics_columns_and_values():
    model = tiny()
    x, y = batches(1, B=2)[0]
    out = diagnose(model, x, y, BF16)
    assert list(out) and set(out) == set(diag_columns(2, 2))
    assert all(p.grad is None for p in model.parameters())  # the probe leaves training's gradients alone
    W_q = model.transformer.h[0].attn.c_attn.weight[:64].detach()
    assert out["sn_q_L0"] == pytest.approx(torch.linalg.svdvals(W_q)[0].item(), rel=1e-5)
    for h, rows in enumerate(W_q.view(2, 32, 64)):   # head h's rows of W_q, as attention splits q into heads
        assert out[f"sn_q_L0_H{h}"] == pytest.approx(torch.linalg.svdvals(rows)[0].item(), rel=1e-5)
    assert 0.0 <= out["tie_rate_L0"] <= 1.0 and out["max_logit_L1"] > 0
    assert out["tie_rate_L0"] == pytest.approx((out["tie_rate_L0_H0"] + out["tie_rate_L0_H1"]) / 2)
    assert out["sharp_rate_L1"] == pytest.approx((out["sharp_rate_L1_H0"] + out["sharp_rate_L1_H1"]) / 2)
    assert out["delta_err_L0"] == pytest.approx((out["delta_err_L0_H0"] + out["delta_err_L0_H1"]) / 2, abs=1e-9)
    assert abs(out["delta_err_L0"]) < 1e-3  # a bf16 rounding of O, not a bug in the probe
    assert out["delta_push_L1"] == pytest.approx((out["delta_push_L1_H0"] + out["delta_push_L1_H1"]) / 2, abs=1e-9)
    # fp32 attention returns the reference itself (cast to bf16): its delta error is that rounding only
    fp32 = diagnose(tiny("fp32"), x, y, BF16)
    assert abs(fp32["delta_err_L1"]) < 1e-3


def test_qk_norm_logs_its_gains_and_the_logits_they_bound():
    """With QK-norm the log gains each layer's largest q and k gain, which bound its logits: a logit is at most
    gain_q * gain_k * sqrt(head_dim) (unit-RMS vectors of head_dim channels, the scores scaled by 1/sqrt(head_dim))."""
    model = tiny(pos="rope", qk_norm=True)
    with torch.no_grad():
        model.transformer.h[1].attn.q_gain[5] = 3.0
    x, y = batches(1, B=2)[0]
    out = diagnose(model, x, y, BF16)
    assert set(out) == set(diag_columns(2, 2, qk_norm=True)) == set(diag_columns(2, 2)) | {
        "gain_q_L0", "gain_k_L0", "gain_q_L1", "gain_k_L1"}
    assert out["gain_q_L1"] == 3.0 and out["gain_k_L1"] == out["gain_q_L0"] == 1.0
    for i in range(2):
        assert 0 < out[f"max_logit_L{i}"] <= out[f"gain_q_L{i}"] * out[f"gain_k_L{i}"] * math.sqrt(32) * 1.01


def test_tie_rate_counts_near_ties_only():
    """Keys 0 and 1 equal and far above the rest: every row but the first (which sees only key 0) is tied."""
    T = 16
    q, k, v = qkv(T=T)
    q = q.abs()
    k[:, :, :2] = 2.0
    O = reference_attention(q, k, v)
    _, tie_rate, *_ = attention_stats(q, k, v, O, torch.ones_like(O))
    assert tie_rate.tolist() == [(T - 1) / T] * q.shape[1]   # per head
    q, k, v = qkv(logit_scale=4.0, T=T)
    _, tie_rate, *_ = attention_stats(q, k, v, O, torch.ones_like(O))
    assert tie_rate.max().item() < 0.05


def test_tie_rate_sees_the_autocast_precisions_rounded_scores():
    """Keys 0 and 1 score 10.0 and 10.02 (q.k = 80 and 80.16, d = 64): 0.02 apart in fp32, more than the tie
    tolerance, but the "autocast" precision rounds q.k to bf16 (80 both) before the scale, so the kernel ties them."""
    T, D = 16, 64
    q = torch.ones(1, 1, T, D, dtype=torch.bfloat16)
    k = torch.zeros(1, 1, T, D, dtype=torch.bfloat16)
    k[:, :, :2] = 1.25
    k[:, :, 1, 0] = 1.41   # bf16 1.4140625: q.k1 = 80.164
    v = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(4)).bfloat16()
    O = reference_attention(q, k, v)
    stats = {p: attention_stats(q, k, v, O, torch.ones_like(O), precision=p) for p in ("fa2", "autocast")}
    assert stats["fa2"][1].item() == 0.0
    assert stats["autocast"][1].item() == (T - 1) / T   # every row that sees both keys
    assert stats["autocast"][0] == stats["fa2"][0]        # the max logit stays the fp32 score's (10.02)


def test_sharp_rate_counts_rows_with_one_dominant_key():
    """Key 0 ~20 nats above every other key: every row puts more than 1 - 1e-3 on it. Drop the gap to ~4.6
    nats (P ~ 0.99 at most) and no row is sharp; the first row (one key, P = 1, nothing to round) never counts."""
    T = 16
    q, k, v = qkv(T=T)
    q = torch.ones_like(q)
    k = torch.zeros_like(k)
    k[:, :, 0] = 20.0 * q.shape[-1] ** 0.5 / q.shape[-1]   # q.k0/sqrt(d) = 20
    O = reference_attention(q, k, v)
    _, _, sharp, *_ = attention_stats(q, k, v, O, torch.ones_like(O))
    assert sharp.tolist() == [1.0] * q.shape[1]   # per head
    k[:, :, 0] = 4.6 * q.shape[-1] ** 0.5 / q.shape[-1]
    _, _, sharp, *_ = attention_stats(q, k, v, O, torch.ones_like(O))
    assert sharp.max().item() == 0.0   # not 1/T: query 0 (P = 1 exactly) is not counted


def test_delta_push_is_the_norm_growth_of_the_gradient_error():
    """delta_push, per head, equals -<dq_err, q> / rows and -<dk_err, k> / rows, where dq_err and dk_err are how
    much the gradients of q and k change when delta is read from the rounded O instead of the exact one
    (float64 backward written out: dS = P * (dO V^T - delta), dq = dS k / sqrt(d), dk = dS^T q / sqrt(d))."""
    q, k, v = qkv(logit_scale=3.0)
    dO = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)) + 1.0
    q64, k64, v64, dO64 = (t.double() for t in (q, k, v, dO))
    S = q64 @ k64.transpose(-2, -1) / math.sqrt(q.size(-1))
    S = S.masked_fill(torch.ones_like(S, dtype=torch.bool).triu(1), float("-inf"))
    P = S.softmax(dim=-1)
    O_exact = P @ v64
    O_bf16 = O_exact.bfloat16()  # what a bf16 kernel stores
    rows = q.shape[0] * q.shape[2]

    def grads(O):
        delta = (dO64 * O).sum(dim=-1, keepdim=True)
        dS = P * (dO64 @ v64.transpose(-2, -1) - delta)
        return dS @ k64 / math.sqrt(q.size(-1)), dS.transpose(-2, -1) @ q64 / math.sqrt(q.size(-1))

    (dq_lp, dk_lp), (dq, dk) = grads(O_bf16.double()), grads(O_exact)
    push_q = -((dq_lp - dq) * q64).sum(dim=(0, 2, 3)) / rows
    push_k = -((dk_lp - dk) * k64).sum(dim=(0, 2, 3)) / rows
    *_, delta_push = attention_stats(q, k, v, O_bf16, dO)
    assert push_q.abs().min() > 1e-4  # the rounding does move the gradients' norms: the check has a size
    assert delta_push.double().tolist() == pytest.approx(push_q.tolist(), rel=1e-3)
    assert delta_push.double().tolist() == pytest.approx(push_k.tolist(), rel=1e-3)


def test_max_logit_is_the_largest_scaled_score_of_every_row_head_and_batch():
    """One key of one head of the second batch element scores 7.5 (q.k = 64 x 0.9375 = 60, over sqrt(64)); every
    other score is 0."""
    q = torch.ones(2, 2, 16, 64, dtype=torch.bfloat16)
    k = torch.zeros_like(q)
    k[1, 1, 3] = 0.9375
    v = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).bfloat16()
    O = reference_attention(q, k, v)
    assert attention_stats(q, k, v, O, torch.ones_like(O))[0].item() == 7.5


def test_delta_err_is_what_delta_reads_over_the_exact_o():
    """O read 0.25 above the exact P V in every channel, dO all ones: delta reads 64 x 0.25 = +16 more than the
    exact delta in every row, so delta_err is +16 per head, and its push that times each row's expected logit."""
    q, k, v = qkv(T=16, D=64)
    S = causal_scores(q, k)
    P = S.softmax(dim=-1)
    O = P @ v.float() + 0.25
    _, _, _, err, push = attention_stats(q, k, v, O, torch.ones_like(O))
    assert err.tolist() == pytest.approx([16.0, 16.0], abs=1e-4)
    expected_logit = (P * S.nan_to_num(neginf=0.0)).sum(dim=-1)
    assert push.tolist() == pytest.approx((16 * expected_logit).mean(dim=(0, 2)).tolist(), rel=1e-4)


def test_the_probe_reads_the_error_of_o_it_is_given(monkeypatch):
    """An fp32 O 0.25 below the O the layer computed: e = +0.25 in every channel, so total is 0.25 x the rows' sum of
    dO and lin 0.25 x the sum of dO with that fp32 O fed downstream (each computed here from the probe's passes), and
    each term's standard error is the sample's (mean_and_se)."""
    model = tiny()
    x, y = batches(1)[0]
    (q, k, v, O), dO = _probe_pass(model, x, y, BF16, PROBE_LAYER)
    below = O.float() - 0.25
    monkeypatch.setattr(diagnostics, "fp32_output", lambda q, k, v, config: below)
    _, dO_clean = _probe_pass(model, x, y, BF16, PROBE_LAYER, replace=below.clone())
    out = delta_probe(model, [(x, y)], BF16)
    total, lin = (mean_and_se([0.25 * g.sum(-1)]) for g in (dO, dO_clean))
    assert out[f"probe_total_L{PROBE_LAYER}"].item() == pytest.approx(total[0].item(), rel=1e-3)
    assert out[f"probe_lin_L{PROBE_LAYER}"].item() == pytest.approx(lin[0].item(), rel=1e-3)
    assert out[f"probe_total_se_L{PROBE_LAYER}"].item() == pytest.approx(total[1].item(), rel=1e-3)
    assert abs(total[0] - lin[0]) > 0.1 * abs(lin[0])   # the two passes' dO differ: lin is not total


def test_mean_and_se_is_the_samples():
    mean, se = mean_and_se([torch.tensor([1.0, 2.0]), torch.tensor([[3.0, 4.0]])])
    assert mean.item() == 2.5 and se.item() == pytest.approx(math.sqrt(5 / 3) / 2, rel=1e-6)
