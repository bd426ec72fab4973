"""The bits law: how much later the default collapses per mantissa bit the amplifier leaves P, and what that
predicts for plain bf16 (P at 7 bits), against the measured bf16 collapse. Reads the tables; seconds.

    python -m experiments.bits_law > results/amplifier/bits_law.txt

From results/amplifier/gpu_runs.csv: the default preset's runs with P rounded to B bits (--mantissa-bits B,
--amplify p), fix off, seed 0, no variant. Per bit count, the median collapse step of the runs that collapsed (runs
without a collapse only bound it from below); a least-squares line through log(collapse step) against B gives the
factor per bit and the step it predicts at B = 7. From results/seed_study/runs.csv: the plain bf16 run of the same
seed (off-s0).
"""
import math
import statistics
from pathlib import Path

from nanolp.runs import read_table
from nanolp.runconfig import Parser

RESULTS = Path(__file__).resolve().parent.parent / "results"
BF16_BITS = 7


def main():
    Parser(prog="python -m experiments.bits_law", description=__doc__.split("\n\n")[0]).parse_args()  # takes no flags
    runs = [r for r in read_table(RESULTS / "amplifier" / "gpu_runs.csv")
            if r["fix"] == "off" and r["seed"] == 0 and r["amplify"] == "p" and not r["variant"]
            and r["delta"] == "o" and r["precision"] == "fa2"]
    collapsed, censored = {}, {}
    for r in runs:
        bits = r["mantissa_bits"]
        if r["collapse_step"] is not None:
            collapsed.setdefault(bits, []).append(r["collapse_step"])
        else:
            censored[bits] = max(censored.get(bits, 0), r["steps"])
    points = {bits: statistics.median(steps) for bits, steps in sorted(collapsed.items())}
    for bits in sorted(set(collapsed) | set(censored)):
        line = f"P at {bits} bits: "
        if bits in collapsed:
            line += f"collapsed at {', '.join(f'{s:,}' for s in sorted(collapsed[bits]))} (median {points[bits]:,.0f})"
        if bits in censored and censored[bits] > max(collapsed.get(bits, [0])):
            line += ("; " if bits in collapsed else "") + f"no collapse in {censored[bits]:,} steps"
        print(line)

    x = list(points)
    y = [math.log(points[b]) for b in x]
    mx, my = statistics.mean(x), statistics.mean(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y)) / sum((a - mx) ** 2 for a in x)
    predicted = math.exp(my + slope * (BF16_BITS - mx))
    bf16 = next(r for r in read_table(RESULTS / "seed_study" / "runs.csv") if r["name"] == "off-s0-nolog")
    print(f"fit through {', '.join(map(str, x))} bits: {math.exp(slope):.2f}x later per bit; "
          f"at {BF16_BITS} bits (plain bf16) {predicted:,.0f} steps")
    measured = bf16["collapse_step"]
    print(f"plain bf16, measured (seed_study/runs.csv, off-s0-nolog): collapsed at {measured:,} steps, "
          f"{predicted / measured:.1f}x sooner than the fit")


if __name__ == "__main__":
    main()
