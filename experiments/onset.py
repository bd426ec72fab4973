"""When does layer 0 take off, which of its heads leads, and how fast is the late runaway? Per run, from its log.

    python -m experiments.onset RUN_DIR [RUN_DIR ...]            -> results/seed_study/onset.txt
    python -m experiments.onset --heads RUN_DIR [RUN_DIR ...]    -> results/seed_study/lead_heads.txt
    python -m experiments.onset --late RUN_DIR [RUN_DIR ...]     -> results/seed_study/late_stage.txt
    python -m experiments.onset --growth RUN_DIR [RUN_DIR ...]   -> results/modern_block/growth.txt

Default: layer 0's max logit at step 10,000 (the base), the first logged step where it exceeds twice the base and
100, the sharp rate (rows whose largest P exceeds 1 - 1e-3) up to the doubling, the first step where the sharp
rate passes 1% and the logit then, and the tie rate's range over steps 5,000-30,000.

--heads: at the first step where layer 0's max logit passes 100 (its take-off), the head whose W_Q spectral norm
has grown the most over its value at the reference step (the lead head); in runs that never take off, the head
that grew the most over the whole run. The reference step is 20,000, or half the take-off step (of the run's
length, without one) where that is before step 20,000 (the "autocast" precision takes off by step 12,000). At the
reference step, that head's norm and its rank among layer 0's six heads (1 = largest), and its tie rate (rows
whose top two scores are within tol), mean over steps 2,000 to the reference + 5,000, with that rate's rank.

--late: the first logged step where layer 0's max logit passes 1e3 and 1e6, the steps between the two, the
collapse step (summary.json; "-" without one) and the steps from 1e6 to the collapse or to the run's last step,
and layer 0's max logit at the last logged step and at its largest.

--growth: what grows in layer 0, at step 10,000, at the last logged step and at its largest: the max logit, the
spectral norms of W_Q and W_K and, with QK-norm, the largest q and k gains, which bound the logits (at most
gain_q * gain_k * sqrt(head_dim)).

Reads log.csv or the thinned log.csv.gz of results/*/runs/ (nanolp.runs.log_path).
"""

import csv
import gzip
import sys
import zlib
from pathlib import Path

from nanolp.runconfig import DamagedFile, read_json
from nanolp.runs import log_path

NAME = 16  # width of the run-name column


def log_rows(run):
    path = log_path(run)
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def onset(run):
    rows = [r for r in log_rows(run) if r.get("max_logit_L0")]
    step = {int(r["step"]): r for r in rows}
    logit = lambda r: float(r["max_logit_L0"])
    sharp = lambda r: float(r["sharp_rate_L0"]) if r.get("sharp_rate_L0") else None
    if 10000 not in step:
        return f"{Path(run).name:{NAME}s} no diagnostic row at step 10,000"
    base = logit(step[10000])
    first = lambda cond: next((int(r["step"]) for r in rows if cond(r)), None)
    doubled, past_100 = first(lambda r: logit(r) > 2 * base), first(lambda r: logit(r) > 100)
    sharp_1pc = first(lambda r: (sharp(r) or 0) > 0.01)
    before = [sharp(r) for r in rows if doubled and int(r["step"]) <= doubled and sharp(r) is not None]
    ties = [float(r["tie_rate_L0"]) for r in rows if 5000 <= int(r["step"]) <= 30000]
    return (f"{Path(run).name:{NAME}s} base {base:5.1f}  2x at {doubled}  >100 at {past_100}  "
            f"sharp rate up to 2x: mean {sum(before) / len(before) if before else float('nan'):.1e} "
            f"max {max(before) if before else float('nan'):.1e}  sharp > 1% at {sharp_1pc} "
            f"(logit {logit(step[sharp_1pc]) if sharp_1pc else float('nan'):.0f})  "
            f"tie rate 5k-30k " + (f"{min(ties):.4f}-{max(ties):.4f}" if ties else "-"))


def heads(run):
    rows = [r for r in log_rows(run) if r.get("sn_q_L0_H0")]
    if not rows:
        return f"{Path(run).name:{NAME}s} no per-head diagnostics"
    norm = lambda r, h: float(r[f"sn_q_L0_H{h}"])
    heads = range(sum(column.startswith("sn_q_L0_H") for column in rows[0]))   # layer 0's, as the run logged them
    takeoff = next((r for r in rows if float(r["max_logit_L0"]) > 100), None)
    end = int((takeoff or rows[-1])["step"])
    ref = 20000 if end > 20000 else end // 2000 * 1000
    at_ref = next((r for r in rows if int(r["step"]) == ref), None)
    if at_ref is None:   # (a take-off or an end before step 2,000: no reference before it)
        return f"{Path(run).name:{NAME}s} no reference step before its {'take-off' if takeoff else 'end'} at {end:,}"
    until = [takeoff] if takeoff else rows
    growth = [max(norm(r, h) for r in until) / norm(at_ref, h) for h in heads]
    lead = max(heads, key=lambda h: growth[h])
    when = f"at take-off (step {int(takeoff['step']):,})" if takeoff else "no take-off, whole run"
    early = [r for r in rows if 2000 <= int(r["step"]) <= ref + 5000]
    tie = [sum(float(r[f"tie_rate_L0_H{h}"]) for r in early) / len(early) for h in heads]
    rank = lambda values, h: sorted(values, reverse=True).index(values[h]) + 1
    norms = [norm(at_ref, h) for h in heads]
    others = [g for h, g in enumerate(growth) if h != lead]
    return (f"{Path(run).name:{NAME}s} {when}: lead head {lead}, W_Q norm x{growth[lead]:.1f} over step {ref:,} "
            f"(the other heads " + (f"x{min(others):.1f}-{max(others):.1f}" if others else "none") +
            f"); at {ref:,} its norm {norms[lead]:.1f}, "
            f"rank {rank(norms, lead)} (largest {max(norms):.1f}); "
            f"tie rate 2k-{(ref + 5000) // 1000}k {tie[lead]:.4f}, "
            f"rank {rank(tie, lead)} (largest {max(tie):.4f})")


def late(run):
    rows = [(int(r["step"]), float(r["max_logit_L0"])) for r in log_rows(run) if r.get("max_logit_L0")]
    if not rows:
        return f"{Path(run).name:{NAME}s} no diagnostic rows"
    first = lambda level: next((s for s, v in rows if v > level), None)
    k, m = first(1e3), first(1e6)
    collapse = read_json(Path(run) / "summary.json").get("collapse_step")   # ({} for a run still in progress)
    stop = collapse or rows[-1][0]
    span = lambda a, b: f"{b - a:,}" if a is not None and b is not None else "-"
    return (f"{Path(run).name:{NAME}s} >1e3 at {k}  >1e6 at {m}  1e3->1e6 {span(k, m)}  collapse {collapse or '-'}  "
            f"1e6->{'collapse' if collapse else 'end'} {span(m, stop)}  last {rows[-1][1]:.1e}  "
            f"largest {max(v for _, v in rows):.1e}")


GROWTH = ("max_logit_L0", "sn_q_L0", "sn_k_L0", "gain_q_L0", "gain_k_L0")   # the gains: QK-norm's runs only


def growth(run):
    rows = [r for r in log_rows(run) if r.get("max_logit_L0")]
    base, last = next((r for r in rows if int(r["step"]) == 10000), None), rows[-1] if rows else None
    if base is None:
        return f"{Path(run).name:{NAME}s} no diagnostic row at step 10,000"
    cells = []
    for column in (c for c in GROWTH if rows[0].get(c)):
        value = lambda r: float(r[column])
        cells.append(f"{column} {value(base):.3g} -> {value(last):.3g} (largest {max(map(value, rows)):.3g})")
    return f"{Path(run).name:{NAME}s} step 10,000 -> {int(last['step']):,}: " + ", ".join(cells)


def main(argv):
    report = {"--heads": heads, "--late": late, "--growth": growth}.get((argv[:1] or [""])[0], onset)
    runs = argv[(report is not onset):]
    if not runs or any(a.startswith("-") for a in runs):
        sys.exit("usage: python -m experiments.onset [--heads | --late | --growth] RUN_DIR [RUN_DIR ...]")
    missing = [run for run in runs if not log_path(run).exists()]
    if missing:
        sys.exit(f"onset: no log.csv or log.csv.gz in {', '.join(missing)}")
    for run in runs:
        try:
            print(report(run))
        except (OSError, EOFError, zlib.error, csv.Error, ValueError, DamagedFile) as e:   # a file it cannot read
            sys.exit(f"onset: {run} cannot be read ({e})")


if __name__ == "__main__":
    main(sys.argv[1:])
