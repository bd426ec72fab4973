"""nanolp/diagnostics.py's delta probe: the error delta reads in one layer, split by the curvature hypothesis."""
import math

import torch

from model import GPT, GPTConfig
from nanolp.diagnostics import PROBE_LAYER, _probe_pass, delta_probe, fp32_output, probe_columns

BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def tiny(attn="emulate"):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64, attn=attn))


def batches(n=2):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(65, (4, 64), generator=g), torch.randint(65, (4, 64), generator=g)) for _ in range(n)]


def test_probe_columns_are_finite_repeatable_and_leave_the_gradients_alone():
    model = tiny()
    out = delta_probe(model, batches(), BF16)
    assert sorted(out) == sorted(probe_columns())
    assert all(math.isfinite(v) for v in out.values())
    assert all(out[c] > 0 for c in out if c.endswith(f"_se_L{PROBE_LAYER}"))
    assert {k: v.item() for k, v in delta_probe(model, batches(), BF16).items()} == {k: v.item() for k, v in out.items()}
    assert all(p.grad is None for p in model.parameters())


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
    assert (dO_clean - dO).abs().max() > 0
    assert (dO_same - dO).abs().max() <= 2e-2 * dO.abs().max()   # bf16 weights vs fp32 weights in the projection
