"""Inputs that isolate the paper's rounding bias: query rows with exactly k tied maximal scores.

Shared by tests/test_mechanism.py, experiments/gradbias.py and experiments/gluon_check.py (the float64 reference)
and experiments/mechanism.py (analyze.py --mechanism).
"""
import math

import torch

V_MEAN, V_STD = -1.0, 0.5     # V ~ N(-1, 0.5): mostly negative, like the paper's failing feature
DO_MEAN, DO_STD = 1.0, 0.5    # dO ~ N(1, 0.5): a gradient with a preferred sign
GAP_RANGE = (12.0, 18.0)      # nats between a row's tied max and its other keys
INPUTS = (f"V ~ N({V_MEAN:g}, {V_STD:g}), dO ~ N({DO_MEAN:g}, {DO_STD:g}), "
          f"other keys {GAP_RANGE[0]:g}-{GAP_RANGE[1]:g} nats below")


def tied_rows(n_rows, n_tied, head_dim=64, generator=None, max_range=(-4.0, 12.0), gap_range=GAP_RANGE,
              v_mean=V_MEAN, v_std=V_STD, dtype=torch.bfloat16, tie_gap=0.0, n_keys=None, copies=False):
    """q, k, v of shape (n_rows // head_dim, 1, n_keys, head_dim): every query row has its own n_tied tied maxima.

    Row i of each block of head_dim rows is q_i = sqrt(d) e_i, so its scaled score with key j is exactly k_j[i]:
    the scores are bf16 numbers, exact in both precision modes, and only the softmax / P V / O rounding is left.
    Every row draws, independently of the others,
      - its max M (a bf16 number, uniform in max_range; the fix's shift depends on M, so M must vary),
      - which n_tied of the keys sit exactly at M,
      - the other keys' scores M - gap, gap uniform in gap_range (rounded to bf16). Gaps of >= ~10 nats make the
        other keys' P tiny next to the tied ones, the regime where they only tip roundings; at a few nats below
        (gap_range (1, 8)) their sum is comparable to the tied P and no clean bias shows.
    tie_gap > 0 makes near-ties instead: one key sits at M, the other n_tied - 1 at M - u tie_gap, u uniform in
    [0, 1) (rounded to bf16; use a small max_range so that bf16 resolves such gaps).
    V ~ N(v_mean, v_std) (mostly negative by default, like the paper's failing feature; dO: grad_out). The rows
    of one block share their keys' V, nothing else. head_dim must be 16 or 64 (sqrt(head_dim) a power of two:
    exact scores).
    n_keys (default head_dim, one key tile): more keys spread the tied ones over several key tiles; q is then
    padded with zero rows to n_keys rows (attention needs as many queries as keys), so only the first head_dim
    rows of each block are the tied rows: measure those.
    copies: the tied keys are copies of one key, value included (a repeated token in a layer without position
    embeddings); all rows of a block then tie at the same keys.
    """
    assert head_dim in (16, 64), "head_dim 16 or 64: scores are exact only when sqrt(head_dim) is a power of two"
    assert n_rows % head_dim == 0 and 1 <= n_tied
    D, B, N = head_dim, n_rows // head_dim, n_keys or head_dim
    assert N >= D and n_tied <= N
    rand = lambda *shape: torch.rand(*shape, generator=generator)  # noqa: E731
    lo, hi = max_range
    M = (lo + (hi - lo) * rand(B, 1, D, 1)).to(dtype).float()
    glo, ghi = gap_range
    S = (M - glo - (ghi - glo) * rand(B, 1, D, N)).to(dtype).float()           # S[b, 0, row, key]
    per = (B, 1, 1, N) if copies else (B, 1, D, N)
    tied = torch.zeros(per, dtype=torch.bool).scatter(-1, rand(*per).argsort(-1)[..., :n_tied], True).expand(B, 1, D, N)
    near = tied & (tied.cumsum(-1) > 1)                                          # all tied keys but the first
    S = torch.where(tied, M, S)
    S = torch.where(near, (M - tie_gap * rand(B, 1, D, N)).to(dtype).float(), S)
    q = torch.eye(N, D).expand(B, 1, N, D) * math.sqrt(D)
    k = S.transpose(-1, -2)                                                      # k_j[i] = S[i, j]
    v = torch.randn(B, 1, N, D, generator=generator) * v_std + v_mean
    if copies:
        first = tied[:, :, 0].int().argmax(-1)                                   # (B, 1): a block's first tied key
        v = torch.where(tied[:, :, 0].unsqueeze(-1), v[torch.arange(B), 0, first[:, 0]][:, None, None], v)
    return q.to(dtype).contiguous(), k.to(dtype).contiguous(), v.to(dtype)


def grad_out(shape, generator=None, mean=DO_MEAN, std=DO_STD, dtype=torch.bfloat16):
    """dO ~ N(mean, std) in bf16, drawn after tied_rows from the same generator."""
    return (torch.randn(shape, generator=generator) * std + mean).to(dtype)


def exact_scores(q, k, causal=False):
    """q k^T / sqrt(d) in float64 from the same (rounded) inputs, -inf above the diagonal where causal."""
    S = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = S.shape[-1]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool, device=S.device).triu(1), -math.inf)
    return S


def reference(q, k, v, causal=False):
    """softmax(q k^T / sqrt(d)) v in float64 from the same (rounded) inputs: the exact answer to compare with."""
    return exact_scores(q, k, causal).softmax(-1) @ v.double()


def mean_error(err):
    """Mean and standard error over rows of the per-row mean error (err: (..., rows, features) or (..., rows))."""
    per_row = (err.mean(-1) if err.dim() == 4 else err).flatten().double()
    return per_row.mean().item(), per_row.std().item() / math.sqrt(per_row.numel())
