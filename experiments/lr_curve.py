"""The failure against the learning rate: per arm (fix off, fix on, fp32 attention, rotary positions with the fix
off and with fp32 attention), the step where layer 0's max logit first passes 100 and the step of the collapse (or
how long a run went without one), against the lr.

    python -m experiments.lr_curve results/lr_sweep/runs.csv results/seed_study/runs.csv results/cure/runs.csv \\
        results/modern_block/runs.csv --out results/lr_sweep      -> lr_curve.csv, figures/lr_curve.png

The lr_sweep study holds the rates other than the default; the default's runs (lr 1e-3) are the seed, cure and
modern-block studies'. A point is a run of the kernel as it ships (nanolp.runconfig.as_shipped), on any seed, whose
flags are one of ARMS, with or without --lr; layer 0's step comes from its kept log (diagnostic rows every 1,000
steps: the first such row past 100; a run without its log kept is not known to have passed it or not). Seed 0 ran at
every rate of its arm: the figure's lines join its runs, and the other seeds stand beside them as the spread.
"""

import shlex
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from nanolp.diagnostics import LOGIT
from nanolp.plots import PALETTE, save
from nanolp.runconfig import Parser, RunError, as_shipped, number_text
from nanolp.runs import load_run, study_rows, write_csv

# flags -> nanolp.plots family (the second arm of a family is drawn in its second shade)
ARMS = {"--fix off": "fix off", "--fix on": "fix on", "--attn fp32": "fp32", "--fix off --pos rope": "fix off",
        "--attn fp32 --pos rope": "fp32"}
PAST = 100.0   # layer 0's max logit where the runaway has begun (fix off's runs at lr 1e-3: 11-23 at step 10,000)
COLUMNS = ["arm", "lr", "seed", "name", "study", "steps", "collapsed", "collapse_step", "log_kept", "past_100_step"]


def flag_items(flags):
    """A command's flags as a set of (flag, value), in whatever order and spelling they come (--lr=1e-3 or --lr
    1e-3): a switch's value None."""
    words, items, i = shlex.split(flags or ""), set(), 0
    while i < len(words):
        name, _, value = words[i].partition("=")
        if not value and i + 1 < len(words) and not words[i + 1].startswith("--"):
            i, value = i + 1, words[i + 1]
        items.add((name, value or None))
        i += 1
    return items


def arm_of(flags):
    """The arm of ARMS whose flags a row's are, with or without --lr: '--lr 3e-3 --fix on' -> '--fix on'; None."""
    items = {item for item in flag_items(flags) if item[0] != "--lr"}
    return next((arm for arm in ARMS if flag_items(arm) == items), None)


def first_past(run, value=PAST):
    """The first logged step where layer 0's max logit exceeds value; None if it never does."""
    series = run.series(LOGIT)
    if series is None:
        return None
    steps, logits = series
    above = np.flatnonzero(logits > value)
    return int(steps[above[0]]) if len(above) else None


def points(tables):
    """One row (COLUMNS) per run of the tables that is a point of the curve, by arm then lr."""
    return curve_points(study_rows(tables))


def curve_points(rows):
    """points of studies' runs.csv rows (nanolp.runs.study_rows: each with its study's `folder` and its `run_dir`)."""
    points = []
    for row in rows:
        arm = arm_of(row["flags"])
        if arm is None or not as_shipped(row) or row.get("variant"):
            continue
        if row["lr"] is None:
            raise ValueError(f"{row['folder'] / 'runs.csv'}: {row['name']} has no lr: the curve needs each run's")
        try:
            run = load_run(row["run_dir"]) if row["log_kept"] else None
        except RunError as e:   # (a damaged log: study_rows has seen that there is one)
            raise ValueError(str(e)) from None   # (DamagedFile's line names the file)
        points.append(dict(arm=arm, lr=row["lr"], seed=row["seed"], name=row["name"], study=row["folder"].name,
                           steps=row["steps"], collapsed=row["collapsed"], collapse_step=row["collapse_step"],
                           log_kept=run is not None, past_100_step=first_past(run) if run else None))
    return sorted(points, key=lambda r: (list(ARMS).index(r["arm"]), r["lr"], r["seed"]))


def markdown(points):
    """The curve as a small markdown table: a row per lr, a column per arm. A cell of one run: the collapse step, or
    the steps run without one, and where layer 0's max logit first passed PAST (or that its log is not kept). A cell of
    several runs (seeds): how many collapsed and the span of their collapse steps, the span of the others' steps
    without one, and the span of the steps past PAST with how many of the runs whose logs are kept passed it (none
    passed: how many have no log, if any)."""
    def span(values):
        low, high = min(values), max(values)
        return f"{low:,}" if low == high else f"{low:,}-{high:,}"

    def one(p):
        end = f"**collapsed at {p['collapse_step']:,}**" if p["collapsed"] else f"no collapse in {p['steps']:,}"
        seed = f"seed {p['seed']}: " if p["seed"] else ""   # (seed 0 ran at every rate of its arm: unnamed)
        past = "; no log" if not p["log_kept"] else (
            f"; past {PAST:g} at {p['past_100_step']:,}" if p["past_100_step"] is not None else "")
        return seed + end + past

    def several(runs):
        fell = [p["collapse_step"] for p in runs if p["collapsed"]]
        held = [p["steps"] for p in runs if not p["collapsed"]]
        past = [p["past_100_step"] for p in runs if p["past_100_step"] is not None]
        parts = ([f"**{len(fell)} collapsed, at {span(fell)}**"] if fell else []) + (
                 [f"{len(held)} ran {span(held)} without" if fell else f"no collapse in {span(held)}"] if held else [])
        logged = sum(p["log_kept"] for p in runs)   # (a run without its log: not known whether it passed)
        of = f"{logged}" if logged == len(runs) else f"the {logged} with logs"
        return f"{len(runs)} runs: " + ", ".join(parts) + (
            f"; past {PAST:g} at {span(past)} ({len(past)} of {of})" if past else "; no log" if not logged else
            f"; {len(runs) - logged} of {len(runs)} without a log" if logged < len(runs) else "")

    lines = ["| lr | " + " | ".join(f"`{arm}`" for arm in ARMS) + " |", "|---|" + "---|" * len(ARMS)]
    for lr in sorted({p["lr"] for p in points}):
        cells = []
        for arm in ARMS:
            runs = [p for p in points if (p["arm"], p["lr"]) == (arm, lr)]
            cells.append(one(runs[0]) if len(runs) == 1 else several(runs) if runs else "-")
        lines.append(f"| {number_text(lr)} | " + " | ".join(cells) + " |")   # 1e-3, as the flags write it
    return lines


def plot(rows, path):
    """Steps against lr, log-log, per arm in its colour: a filled dot at the collapse, an open dot where layer 0
    passed 100, a triangle at a run's end without a collapse (it would collapse later, if at all); a line joins seed
    0's runs, the other seeds' marks stand alone."""
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for i, (arm, family) in enumerate(ARMS.items()):
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        shades = PALETTE[family]
        colour = shades[list(ARMS.values())[:i].count(family) % len(shades)]
        shift = 1.04 ** (i - (len(ARMS) - 1) / 2)   # arms side by side at each lr, not on top of each other
        lr = np.array([r["lr"] for r in mine]) * shift
        end = np.array([r["collapse_step"] if r["collapsed"] else r["steps"] for r in mine], dtype=float)
        first = np.array([r["seed"] == 0 for r in mine])
        ax.plot(lr[first], end[first], color=colour, linewidth=1.2, label=f"python train.py {arm}")
        fell = np.array([r["collapsed"] for r in mine])
        ax.plot(lr[fell], end[fell], "o", color=colour, markersize=8)
        ax.plot(lr[~fell], end[~fell], "^", color=colour, markersize=9, markerfacecolor="white")
        past = np.array([np.nan if r["past_100_step"] is None else r["past_100_step"] for r in mine], dtype=float)
        ax.plot(lr[first], past[first], ":", color=colour, linewidth=1)
        ax.plot(lr, past, "o", color=colour, markersize=7, markerfacecolor="white", linestyle="none")
    for marker, fill, text in (("o", "gray", "the collapse"), ("^", "white", "the run's end, no collapse"),
                               ("o", "white", f"layer 0's max logit past {PAST:g} (dotted)")):
        ax.plot([], [], marker, color="gray", markerfacecolor=fill, label=text)
    ax.set_xscale("log")
    ax.set_yscale("log")
    rates = sorted({r["lr"] for r in rows})
    ax.set_xticks(rates, [f"{lr:g}" for lr in rates])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("learning rate (the default preset otherwise; lines join seed 0's runs)")
    ax.set_ylabel("step")
    ax.set_title("the failure against the learning rate")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save(fig, path)


def main(argv=None):
    p = Parser(prog="python -m experiments.lr_curve", description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+", help="studies' runs.csv (the lr sweep's and the default lr's)")
    p.add_argument("--out", type=Path, help="where lr_curve.csv and figures/ go (default: the first table's folder)")
    args = p.parse_args(argv)
    args.out = args.out or Path(args.tables[0]).parent
    missing = [t for t in args.tables if not Path(t).is_file()]
    if missing:
        p.error(f"no such file: {', '.join(missing)}")
    try:
        rows = points(args.tables)
    except ValueError as e:
        p.error(str(e))
    if not rows:
        p.error(f"no run of {', '.join(ARMS)} in {', '.join(args.tables)}")
    try:
        (args.out / "figures").mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a file of that name, or a folder that cannot be written
        p.error(f"--out must be a folder: cannot make {args.out / 'figures'} ({e.strerror})")
    write_csv(args.out / "lr_curve.csv", rows, COLUMNS)
    plot(rows, args.out / "figures" / "lr_curve.png")
    for r in rows:
        end = f"collapsed at {r['collapse_step']:,}" if r["collapsed"] else f"no collapse in {r['steps']:,}"
        print(f"{r['arm']:22s} lr {r['lr']:<7g} {r['name']:20s} {end:24s} layer 0 past {PAST:g}: "
              f"{(r['past_100_step'] or '-') if r['log_kept'] else 'no log'}")


if __name__ == "__main__":
    main()
