"""Why delta's error is one-signed even when O's rounding is not: the curvature effect, on a loss we know exactly.

The backward's delta = rowsum(dO * O) reads the forward's bf16 O = o + e (o the fp32 O, e its rounding error). dO
is computed downstream of that same rounded O, so it depends on e: for a loss L(O) with gradient g at o and
curvature H (with respect to O), to first order dO(o + e) = g + H e. Then the error that delta reads, against
delta from the fp32 O, is

    rowsum(dO * e) = g . e + e^T H e,        whose mean is   E[g . e] + tr(H Sigma_e)

The first term averages to zero whenever e is unbiased. The second does not: near a minimum H is positive
definite, so it is positive, proportional to the rounding's variance Sigma_e, and largest relative to the noise of
the first term when g is tiny (after the model has memorised its data). Stochastic rounding is unbiased too, but
has twice the variance of round-to-nearest on average, so it doubles the effect. An independent rounding (delta
reading a draw that the forward never saw) is uncorrelated with dO and averages to zero.

synthetic_delta_error() measures this on rows of a quadratic loss L(O) = sum over rows of
g . O + 1/2 O^T H O with H symmetric positive definite and known, so tr(H Sigma_e) can be computed exactly and
compared with the measured mean error. tests/test_curvature.py checks the three claims; analyze.py --mechanism
(experiments/mechanism.py) draws them (results/mechanism/curvature.png); nanolp/diagnostics.py's probe measures the
same terms in the model.
"""
import math

import torch

from kernels import stochastic_round

ROUNDINGS = ("nearest", "stochastic", "independent")


def bf16_neighbours(o):
    """The bf16 numbers just below and above fp32 o (equal where o is a bf16 number), as float64."""
    near = o.to(torch.bfloat16)
    below, above = (torch.nextafter(near, torch.full_like(near, inf)).float() for inf in (-math.inf, math.inf))
    down = torch.where(near.float() > o, below, near.float())
    up = torch.where(down == o, down, torch.where(near.float() > o, near.float(), above))
    return down.double(), up.double()


def rounding_variance(o, rounding):
    """Per-element variance of the error that bf16 rounding of o makes: round-to-nearest's error is spread
    uniformly over one bf16 step w (w^2/12, taken over the ensemble of o); stochastic rounding's is exactly
    w^2 f (1 - f) for o a fraction f of the way from its lower neighbour."""
    down, up = bf16_neighbours(o)
    step = up - down
    if rounding == "nearest":
        return step ** 2 / 12
    f = torch.where(step > 0, (o.double() - down) / step.clamp_min(1e-300), 0.0)
    return step ** 2 * f * (1 - f)


def synthetic_delta_error(rounding, rows=200_000, dim=64, curvature=1.0, gradient=1e-3, seed=0):
    """Mean and standard error of delta's error rowsum(dO * e') on rows of the quadratic loss, and the predicted
    mean tr(H Sigma_e).

    rounding: "nearest" or "stochastic": the forward's O is o rounded that way, dO is the loss's gradient there and
        delta reads that same O (e' = e); "independent": the forward rounds to nearest, delta reads an independent
        stochastic rounding of o (e' independent of dO; predicted mean 0).
    curvature: H's eigenvalues are uniform in [0.5, 1.5] * curvature (random eigenvectors).
    gradient: the rows sit this far (rms, per element) from the loss's minimum, so the true gradient g = H (o - o*)
        is small, as after memorisation. Returns dict(mean, se, predicted)."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
    gen = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
    eig = curvature * (0.5 + torch.rand(dim, generator=gen, dtype=torch.float64))
    H = basis @ torch.diag(eig) @ basis.T
    minimum = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    o = (minimum + gradient * torch.randn(rows, dim, generator=gen, dtype=torch.float64)).float()
    g = (o.double() - minimum) @ H                              # the gradient at the fp32 o (H is symmetric)
    forward = stochastic_round(o, gen) if rounding == "stochastic" else o.to(torch.bfloat16)
    e = forward.double() - o.double()
    dO = g + e @ H                                              # the gradient where the forward's O really is
    read = e if rounding != "independent" else stochastic_round(o, gen).double() - o.double()
    err = (dO * read).sum(-1)
    variance = rounding_variance(o, "nearest" if rounding == "independent" else rounding)
    predicted = 0.0 if rounding == "independent" else (variance * torch.diagonal(H)).sum(-1).mean().item()
    return dict(mean=err.mean().item(), se=err.std().item() / math.sqrt(rows), predicted=predicted)
