"""Does a backward's dS have rows that do not sum to zero, and does delta from P remove them? (CPU, ~20 s)

    python -m experiments.row_sums > results/paper_precision/row_sums.txt

An exact softmax backward gives dS = P * (dP - delta), whose rows sum to zero; whatever a kernel's dS sums to per
row is an error of the one kind the paper's mechanism is about (it changes dS by a multiple of P, as an error in
delta does; nanolp/diagnostics.py, delta_push). In the autocast precision l is summed in bf16, so the backward's
P = exp(S - lse) sums to 1 / (1 + eps) per row, not 1, and with delta = rowsum(dP * P) a row's dS sums to
delta * (1 - rowsum(P)); --delta p therefore divides by rowsum(P) there, which zeroes those row sums. This
measures, with the PyTorch emulation of the kernel (bit for bit the kernel's numerics, tests/test_kernels.py), per
arm the rms over rows of rowsum(dS) before dS's cast, and for each precision the mean and spread of 1 - rowsum(P),
also by how sharp the row is. Random bf16 inputs (3 x 2 heads x 256 rows, q scaled by 1 / 3 / 8 for soft to sharp
rows); the arm "autocast, from P, undivided" leaves out the division.
"""
import torch

from kernels import Numerics
from nanolp import emulate
from nanolp.runconfig import Parser


def rand(shape, seed):
    """N(0, 1) values rounded to bf16, on the CPU, from their own seed."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def row_sums(q, k, v, do, precision, delta="o", undivided=False):
    """(rowsum(dS) before its cast, 1 - rowsum(P), the row's largest exact probability) per row, as the kernel's
    backward computes them with delta from what `delta` names (Numerics.delta's "o", "fp32-o" or "p"); undivided:
    delta from P without its division by rowsum(P) in the autocast precision (the kernel variant paper-undivided of
    results/paper_precision/rounding_variants.csv)."""
    o, o32, lse = emulate.forward(q, k, v, True, False, Numerics(precision=precision))
    P, dP = emulate._probs_and_dp(q, k, v, lse, do, True, precision)
    delta = emulate.delta(q, k, v, o32 if delta == "fp32-o" else o, lse, do, True, precision, delta == "p")
    if undivided:
        delta = sum(emulate._rowsum((P * dP)[..., cols]) for cols in emulate._delta_tiles(*q.shape[-2:]))
    dS = P * (dP - delta.unsqueeze(-1))
    exact = torch.softmax(emulate._mask(q.double() @ k.double().mT * q.shape[-1] ** -0.5, 0, q.shape[-2], True), -1)
    return dS.double().sum(-1).flatten(), 1 - P.double().sum(-1).flatten(), exact.amax(-1).flatten()


if __name__ == "__main__":
    Parser(prog="python -m experiments.row_sums", description=__doc__.split("\n\n")[0]).parse_args()  # takes no flags
    arms = {"fa2": ("fa2",), "fa2, delta from P": ("fa2", "p"), "autocast": ("autocast",),
            "autocast, --delta fp32-o": ("autocast", "fp32-o"), "autocast, delta from P": ("autocast", "p"),
            "autocast, from P, undivided": ("autocast", "p", True)}
    print("rms over rows of rowsum(dS) (an exact backward: 0), x fa2's, by q scale 1 / 3 / 8; and 1 - rowsum(P)")
    inputs = {scale: [((rand((1, 2, 256, 64), seed=200 + 10 * s).float() * scale).to(torch.bfloat16),
                       *(rand((1, 2, 256, 64), seed=200 + 10 * s + i) for i in (1, 2, 3))) for s in range(3)]
              for scale in (1, 3, 8)}
    base, gaps = None, {}   # gaps: 1 - rowsum(P) and max P, per precision (the same in each of its arms)
    for arm, args in arms.items():
        rms, gap, max_p = [], [], []
        for scale, batch in inputs.items():
            sums, g, m = zip(*(row_sums(*qkvdo, *args) for qkvdo in batch))
            rms.append(torch.cat(sums).pow(2).mean().sqrt().item())
            gap, max_p = gap + list(g), max_p + list(m)
        base = base or rms
        gaps[args[0]] = gap, max_p = torch.cat(gap), torch.cat(max_p)
        print(f"{arm:27s} rms {' / '.join(f'{r:.2e}' for r in rms)}  (x fa2 "
              f"{' / '.join(f'{r / b:.2f}' for r, b in zip(rms, base))});  1 - rowsum(P): mean {gap.mean():+.1e}, "
              f"rms {gap.pow(2).mean().sqrt():.1e}, > 0 in {(gap > 0).double().mean():.0%} of rows")
    print("1 - rowsum(P) by the row's largest probability (float64), the rows above")
    for precision, (gap, max_p) in gaps.items():
        for lo, hi in ((0, 0.9), (0.9, 0.99), (0.99, 0.999), (0.999, 1)):
            rows = (max_p > lo) & (max_p <= hi)
            print(f"{precision:8s} max P in ({lo}, {hi}]: {int(rows.sum()):4d} rows, mean {gap[rows].mean():+.1e} "
                  f"(1 - max P: {(1 - max_p[rows]).mean():.1e}), < 0 in {(gap[rows] < 0).double().mean():.0%}")
