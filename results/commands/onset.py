"""When does layer 0 take off, and how common are tied and sharp rows in layer 0 before it? (session 10, point 3)

    python results/commands/onset.py RUN_DIR [RUN_DIR ...]

Per run, from log.csv: layer 0's max logit at step 10,000 (the base), the first logged step where it exceeds
twice the base and 100, the sharp rate (rows whose largest P exceeds 1 - 1e-3) up to the doubling, the first step
where the sharp rate passes 1% and the logit then, and the tie rate's range over steps 5,000-30,000.
"""

import csv
import sys
from pathlib import Path


def onset(run):
    rows = [r for r in csv.DictReader(open(Path(run) / "log.csv")) if r.get("max_logit_L0")]
    step = {int(r["step"]): r for r in rows}
    logit = lambda r: float(r["max_logit_L0"])
    sharp = lambda r: float(r["sharp_rate_L0"]) if r.get("sharp_rate_L0") else None
    base = logit(step[10000])
    first = lambda cond: next((int(r["step"]) for r in rows if cond(r)), None)
    doubled, past_100 = first(lambda r: logit(r) > 2 * base), first(lambda r: logit(r) > 100)
    sharp_1pc = first(lambda r: (sharp(r) or 0) > 0.01)
    before = [sharp(r) for r in rows if doubled and int(r["step"]) <= doubled and sharp(r) is not None]
    ties = [float(r["tie_rate_L0"]) for r in rows if 5000 <= int(r["step"]) <= 30000]
    return (f"{Path(run).name:9s} base {base:5.1f}  2x at {doubled}  >100 at {past_100}  "
            f"sharp rate up to 2x: mean {sum(before) / len(before) if before else float('nan'):.1e} "
            f"max {max(before) if before else float('nan'):.1e}  sharp > 1% at {sharp_1pc} "
            f"(logit {logit(step[sharp_1pc]) if sharp_1pc else float('nan'):.0f})  "
            f"tie rate 5k-30k {min(ties):.4f}-{max(ties):.4f}")


if __name__ == "__main__":
    for run in sys.argv[1:]:
        print(onset(run))
