"""The curvature effect (experiments/curvature.py): on a quadratic loss with known curvature H, the error that
delta = rowsum(dO * O) reads from a rounded O has mean tr(H Sigma_e) > 0 for round-to-nearest and for (unbiased)
stochastic rounding, because dO is computed at the rounded O; an independent rounding averages to zero."""
import pytest
import torch

from experiments.curvature import rounding_variance, synthetic_delta_error
from kernels import stochastic_round


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
@pytest.mark.parametrize("gradient", [1e-3, 1e-1])
def test_correlated_rounding_gives_the_predicted_positive_mean(rounding, gradient):
    r = synthetic_delta_error(rounding, rows=100_000, gradient=gradient, seed=1)
    assert r["predicted"] > 20 * r["se"], "the effect must be measurable at this size"
    assert abs(r["mean"] - r["predicted"]) < 4 * r["se"] + 0.02 * r["predicted"], r


def test_stochastic_rounding_doubles_it():
    nearest, stochastic = (synthetic_delta_error(r, rows=100_000, seed=2) for r in ("nearest", "stochastic"))
    assert stochastic["mean"] / nearest["mean"] == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("gradient", [1e-3, 1e-1])
def test_an_independent_rounding_averages_to_zero(gradient):
    correlated = synthetic_delta_error("nearest", rows=100_000, gradient=gradient, seed=3)
    r = synthetic_delta_error("independent", rows=100_000, gradient=gradient, seed=3)
    assert abs(r["mean"]) < 4 * r["se"] and abs(r["mean"]) < 0.1 * correlated["mean"], r


def test_rounding_variance_matches_the_draws():
    o = torch.randn(200_000) * 3
    e_sr = torch.stack([stochastic_round(o, torch.Generator().manual_seed(s)).double()
                        - o.double() for s in range(2)])
    assert e_sr.mean().abs() < 4 * e_sr.std() / e_sr.numel() ** 0.5           # unbiased
    assert e_sr.pow(2).mean().item() == pytest.approx(rounding_variance(o, "stochastic").mean().item(), rel=0.02)
    e_rn = o.to(torch.bfloat16).double() - o.double()
    assert e_rn.pow(2).mean().item() == pytest.approx(rounding_variance(o, "nearest").mean().item(), rel=0.02)


def test_bad_rounding_is_refused():
    with pytest.raises(ValueError, match="rounding"):
        synthetic_delta_error("up")
