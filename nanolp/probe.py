"""The delta probe read back from run logs (nanolp/diagnostics.py computes it in training): per arm, each of its
four terms pooled over the checkpoints of each phase of layer 0's runaway. `python analyze.py --probe RUN...`.

A checkpoint is a log row with the probe's columns. Its phase is where layer 0's max logit stands at that row
against the same run's value at step REFERENCE_STEP, before any run's take-off (findings.md dates the onset by its
doubling): phase 1 below 2x, phase 2 from 2x to 10x, phase 3 beyond 10x. A run without a logged step
REFERENCE_STEP has no phases and is left out.

Within an arm, and the text the probe read (probe_batches), every checkpoint of a phase weighs the same: the
pooled mean is the plain mean of the checkpoints' means, its standard error sqrt(sum se_i^2) / n from theirs (the
probe's noise taken as independent from one checkpoint to the next: the model has moved on; runs made before commit
2e181a3 drew the noise of curv and indep once for all their checkpoints, which this s.e. does not allow for, and
later runs draw it per checkpoint). Weighting by inverse variance instead hands the pool to the quietest
checkpoints, the first ones, before the model memorises its text; in a run of the shift with the fp32 O it turns
the curvature term's sign.

The hypothesis predicts probe_total = probe_curv > 0 and probe_lin = probe_indep = 0.
"""

import re

import matplotlib.pyplot as plt
import numpy as np

from nanolp.diagnostics import LOGIT, PROBE_LAYER, PROBE_TERMS
from nanolp.plots import run_styles, save, step_axis
from nanolp.runs import write_csv

REFERENCE_STEP = 10_000
PHASE_BOUNDS = (2.0, 10.0)  # phase 2 starts at 2x the reference logit, phase 3 past 10x
PHASES = {1: "below 2x", 2: "2-10x", 3: "beyond 10x"}
TERM_NAMES = dict(total="rowsum(dO * e), what delta reads", lin="rowsum(dO_clean * e), dO not seeing e",
                  curv="the curvature term, tr(H Sigma_e)", indep="an independent rounding of O")
TERM_COLOURS = dict(total="black", lin="tab:blue", curv="tab:red", indep="tab:green")
CSV_COLUMNS = ["arm", "probe_batches", "phase", "term", "mean", "se", "t", "checkpoints", "runs", "first_step",
               "last_step"]


def column(term, se=False):
    return f"probe_{term}{'_se' if se else ''}_L{PROBE_LAYER}"


def probe_batches(run):
    """The text the run's probe read: "validation" or "train". train.py's probe read fixed validation batches when
    it was added (commit 0a2f26d) and fixed training batches from commit fb7484d on, the commit that also dropped
    the `schedule` setting, so a config.json that has `schedule` was written by a train.py that probed validation
    batches."""
    return "validation" if "schedule" in run.config else "train"


def reference_logit(run):
    """Layer 0's max logit at step REFERENCE_STEP; None if that step has no value."""
    series = run.series(LOGIT)
    if series is None or not (series[0] == REFERENCE_STEP).any():
        return None
    return float(series[1][series[0] == REFERENCE_STEP][0])


def phase_of(logit, reference):
    """1, 2 or 3 for each logit (0 where it is NaN)."""
    ratio = np.asarray(logit, dtype=float) / reference
    return np.where(np.isnan(ratio), 0, np.where(ratio < PHASE_BOUNDS[0], 1, np.where(ratio <= PHASE_BOUNDS[1], 2, 3)))


def checkpoints(run, term):
    """(steps, phases, means, standard errors) of one term over the run's checkpoints that have it and a logit;
    None if the run has no phases (no value at REFERENCE_STEP) or no such checkpoint."""
    reference = reference_logit(run)
    if reference is None or column(term) not in run.log or column(term, True) not in run.log:
        return None
    step, logit, mean, se = (run.log[c] for c in ("step", LOGIT, column(term), column(term, True)))
    phase = phase_of(logit, reference)
    keep = np.isfinite(mean) & np.isfinite(se) & (phase > 0)
    return (step[keep], phase[keep], mean[keep], se[keep]) if keep.any() else None


def pool(means, ses):
    """(mean, se, t) of the checkpoints' equally weighted mean."""
    mean, se = float(np.mean(means)), float(np.sqrt(np.sum(np.square(ses)))) / len(means)
    return mean, se, mean / se if se > 0 else float("nan")


def pooled_checkpoints(group, term):
    """(steps, phases, means, standard errors, run index) of one term over the checkpoints of every run of
    `group`; None if none has one."""
    found = [c for c in (checkpoints(run, term) for run in group) if c is not None]
    if not found:
        return None
    index = np.concatenate([np.full(len(c[0]), i) for i, c in enumerate(found)])
    return (*(np.concatenate(parts) for parts in zip(*found)), index)


def pooled_phases(runs, arm):
    """One row per (arm, probe_batches, phase, term) that has checkpoints, with the columns CSV_COLUMNS; arm(run)
    names a run's arm. Arms in the order they first appear, then the probe's text, the phase and the term."""
    groups = {}
    for run in runs:
        groups.setdefault((arm(run), probe_batches(run)), []).append(run)
    rows = []
    for (name, batches), group in groups.items():
        pooled = {term: pooled_checkpoints(group, term) for term in PROBE_TERMS}
        for phase in PHASES:
            for term, found in pooled.items():
                if found is None or not (found[1] == phase).any():
                    continue
                step, _, mean, se, index = (a[found[1] == phase] for a in found)
                mean, se, t = pool(mean, se)
                rows.append(dict(arm=name, probe_batches=batches, phase=phase, term=term, mean=mean, se=se, t=t,
                                 checkpoints=len(step), runs=len(set(index.tolist())), first_step=int(step.min()),
                                 last_step=int(step.max())))
    return rows


def cell(row):
    return f"{row['mean']:+.2e} ± {row['se']:.1e} (t {row['t']:+.1f})" if row else "-"


def phase_table(rows, key="arm"):
    """The pooled rows as markdown, one line per (key, probe_batches, phase) and a cell per term."""
    lines = [f"| {key} | probe read | phase | checkpoints (runs) | steps | "
             + " | ".join(f"probe_{term}" for term in PROBE_TERMS) + " |", "|" + "---|" * (5 + len(PROBE_TERMS))]
    lines_of = {}
    for row in rows:
        lines_of.setdefault((row[key], row["probe_batches"], row["phase"]), {})[row["term"]] = row
    for (name, batches, phase), terms in lines_of.items():
        first = terms.get("total") or next(iter(terms.values()))
        lines.append(f"| `{name}` | {batches} | {phase} ({PHASES[phase]}) | {first['checkpoints']} ({first['runs']}) | "
                     f"{first['first_step']:,}-{first['last_step']:,} | "
                     + " | ".join(cell(terms.get(term)) for term in PROBE_TERMS) + " |")
    return lines


def plot_phases(rows, colours, path):
    """A panel per term, one scale for all four: each (arm, probe_batches)'s pooled mean per phase with 2 s.e.
    bars, filled for training batches, open for validation batches. colours: {arm: colour}."""
    fig, axes = plt.subplots(1, len(PROBE_TERMS), figsize=(4.2 * len(PROBE_TERMS), 4.2), sharey=True)
    groups = list(dict.fromkeys((row["arm"], row["probe_batches"]) for row in rows))
    width = 0.6 / max(len(groups), 1)
    for ax, term in zip(axes, PROBE_TERMS):
        for i, (name, batches) in enumerate(groups):
            picked = [r for r in rows if (r["arm"], r["probe_batches"], r["term"]) == (name, batches, term)]
            x = np.array([r["phase"] for r in picked]) + (i - (len(groups) - 1) / 2) * width
            ax.errorbar(x, [r["mean"] for r in picked], yerr=[2 * r["se"] for r in picked], fmt="o", capsize=3,
                        color=colours[name], markerfacecolor=colours[name] if batches == "train" else "white",
                        label=f"{name}, probe on {batches} batches")
        ax.axhline(0, color="k", linewidth=0.6)
        ax.set_xticks(list(PHASES), [f"{p}: {text}" for p, text in PHASES.items()], fontsize=8)
        ax.set_xlabel(f"phase ({LOGIT} against its value at step {REFERENCE_STEP:,})", fontsize=8)
        ax.set_title(f"probe_{term}: {TERM_NAMES[term]}", fontsize=9)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("pooled mean per row (bars: 2 s.e.)")
    if groups:
        axes[0].legend(fontsize=8, loc="best")
    fig.suptitle(f"The delta probe in layer {PROBE_LAYER}, per arm and phase: checkpoints weighted equally "
                 "(predicted: total = curv > 0, lin = indep = 0)", fontsize=10)
    fig.tight_layout()
    return save(fig, path)


def plot_runs(runs, labels, path):
    """Per run: the four terms' means with 2 s.e. bands against steps (the curvature term, ~100x smaller, in a
    panel of its own scale below the other three), and layer 0's max logit beside them with the phase bounds.
    labels: {run.path: the run's arm}."""
    fig = plt.figure(figsize=(13, 6.4 * len(runs)))
    grid = fig.add_gridspec(2 * len(runs), 2, width_ratios=(2, 1))
    for i, run in enumerate(runs):
        terms = fig.add_subplot(grid[2 * i, 0])
        panels = dict(total=terms, lin=terms, indep=terms, curv=fig.add_subplot(grid[2 * i + 1, 0], sharex=terms))
        logit = fig.add_subplot(grid[2 * i:2 * i + 2, 1])
        for term in PROBE_TERMS:
            mean, se = run.series(column(term)), run.series(column(term, True))
            if mean is None or se is None:
                continue
            ax = panels[term]
            ax.plot(*mean, color=TERM_COLOURS[term], linewidth=1.2, label=f"probe_{term}: {TERM_NAMES[term]}")
            ax.fill_between(se[0], mean[1] - 2 * se[1], mean[1] + 2 * se[1], color=TERM_COLOURS[term], alpha=0.15,
                            linewidth=0)
        terms.set_title(f"{labels[run.path]}, seed {run.setting('seed', 0)}, probe on {probe_batches(run)} batches: "
                        f"the error delta reads from O's cast in layer {PROBE_LAYER}, mean over the probe's rows "
                        "(bands: 2 s.e.)", fontsize=10)
        logit.plot(*run.series(LOGIT), color="tab:purple")
        reference = reference_logit(run)
        for bound in PHASE_BOUNDS if reference is not None else ():
            logit.axhline(bound * reference, color="k", linestyle=":", linewidth=0.8)
        logit.set_yscale("log")
        logit.set_title(f"{LOGIT} (dotted: the phase bounds, {' and '.join(f'{b:g}x' for b in PHASE_BOUNDS)} its "
                        f"value at step {REFERENCE_STEP:,})", fontsize=9)
        found = checkpoints(run, "total")   # dashed lines where each later phase is first entered
        starts = [] if found is None else [found[0][found[1] == p][0] for p in (2, 3) if (found[1] == p).any()]
        for ax in (terms, panels["curv"], logit):
            if ax is not logit:
                ax.axhline(0, color="k", linewidth=0.6)
                ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
                ax.legend(fontsize=8, loc="upper left")
            for start in starts:
                ax.axvline(start, color="gray", linestyle="--", linewidth=0.8)
            ax.set_xlabel("step")
            step_axis(ax.xaxis)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, path)


def file_word(arm):
    """An arm's label as a file name's word: "--fix off (before --exponent)" -> "fix-off-before-exponent"."""
    return re.sub(r"[^a-z0-9.]+", "-", arm.lower()).strip("-")


def report(runs, arm, out):
    """probe_phases.csv (pooled_phases), probe_runs.csv (the same per run, so seeds can be compared),
    probe_phases.png and delta_probe_ARM.png (per arm: each run's checkpoints against steps) in the folder out, for
    runs that have the probe's columns; prints the table and returns report.md's section as markdown lines.
    arm(run) names a run's arm."""
    labels = {run.path: arm(run) for run in runs}
    rows = pooled_phases(runs, arm)
    write_csv(out / "probe_phases.csv", rows, CSV_COLUMNS)
    # a run by its folder as given: two studies may each have an off-s0
    per_run = [{"run": row.pop("arm"), **row} for row in pooled_phases(runs, lambda run: str(run.path))]
    write_csv(out / "probe_runs.csv", per_run, ["run"] + CSV_COLUMNS[1:])
    table = phase_table(rows)
    print("\n".join(table))
    styles = run_styles(runs, labels)
    colours, arms = {}, {}   # an arm is drawn in its first run's colour; a per-run figure per arm, so that none
    for run in runs:         # grows with every run committed
        colours.setdefault(labels[run.path], styles[run.path]["color"])
        arms.setdefault(labels[run.path], []).append(run)
    figures = [plot_phases(rows, colours, out / "probe_phases.png")] \
        + [plot_runs(members, labels, out / f"delta_probe_{file_word(name)}.png") for name, members in arms.items()]
    lines = ["## Delta probe", "", f"The error the backward's delta would read from O's bf16 cast in layer "
             f"{PROBE_LAYER}, split as the curvature hypothesis splits it (nanolp/diagnostics.py). Predicted: "
             "probe_total = probe_curv > 0, probe_lin = probe_indep = 0.", "",
             f"Pooled per arm, the text the probe read and the phase of {LOGIT} against the run's value at step "
             f"{REFERENCE_STEP:,} (1: {PHASES[1]}, 2: {PHASES[2]}, 3: {PHASES[3]}); every checkpoint weighs the "
             "same, s.e. from the checkpoints' own (nanolp/probe.py). Cells: mean ± s.e. (t = mean / s.e.); "
             "also in probe_phases.csv.", ""] + table + ["", "Per run (probe_runs.csv):", ""] \
        + phase_table(per_run, key="run") + ["", "Runs:", ""]
    for run in runs:
        reference = reference_logit(run)
        lines.append(f"- `{run.path}` (`{labels[run.path]}`, seed {run.setting('seed', 0)}): probe on "
                     f"{probe_batches(run)} batches; " + (f"{LOGIT} {reference:.3g} at step {REFERENCE_STEP:,}"
                                                          if reference is not None else
                                                          f"left out: no {LOGIT} at step {REFERENCE_STEP:,}"))
    return lines + ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]
