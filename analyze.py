"""The last chapter: what the runs show, in figures and a short report, and the rounding bias without training.

    python analyze.py RUN... [--out DIR]         headline.png (per arm of the kernel as it ships: each run's loss
                                                 and layer 0's max logit, the share not yet collapsed; the other
                                                 runs in headline_earlier_kernels.png), the train and val loss
                                                 (loss.png), per-layer figures, rates.csv
                                                 (per arm: collapsed, medians) and report.md, into DIR (by default
                                                 the runs' folder's figures/: runs/figures for `python analyze.py runs`)
    python analyze.py --probe RUN... --out DIR   probe_phases.csv and .png: the probe's terms per arm, pooled per
                                                 phase of layer 0's runaway, per run probe_runs.csv;
                                                 delta_probe_ARM.png: per arm
    python analyze.py --mechanism --out DIR      the bias on synthetic rows (CPU, about a minute)
    python analyze.py --table STUDY/runs.csv...  the tables of a study (or one of several) in README.md,
                                                 results/README.md and docs/findings.md: per command, how many
                                                 collapsed, when (and findings' tables by learning rate and
                                                 of each run's lowest losses)

What the runs show, and why: docs/findings.md.
Runs are named by their arm: the train.py flags that set them apart from their preset.
"""

import argparse
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from experiments import lr_curve   # the by-lr table: the learning-rate curve's points
from experiments.mechanism import demonstrate   # --mechanism: a study on synthetic rows, no runs
from nanolp import probe
from nanolp.diagnostics import LOGIT, PROBE_LAYER, SHARP_EPS, TIE_TOL   # the runaway layer, its column; sharp, tied
from nanolp.emulate import OURS   # the attentions that take --fix and the numerics (nanolp.runconfig.NUMERICS)
from nanolp.plots import arm_hues, family, plot_grid, run_styles, save, step_axis
from nanolp.runs import STUDY_COLUMNS, find_runs, load_runs, study_rows, study_runs, write_csv
from nanolp.runconfig import BEFORE_OPTION, GPT2_BLOCK, Parser, arm_flags, as_shipped, with_preset
from train import PRESETS, TINY_NOTE

# -----------------------------------------------------------------------------
# Arms: a run is named by the train.py flags that set it apart from its preset

def arm(run):
    """The run's flags (nanolp.runconfig.arm_flags): "--fix off", "--fix on --lr 0.003", "--attn sdpa". A setting an
    older run did not record reads as its default, but for the exponent (nanolp.runconfig.BEFORE_OPTION): such a run
    of our kernel ran neither form, and reads "(before --exponent)"."""
    ours = with_preset(run.settings, PRESETS)["attn"] in OURS
    return " ".join([arm_flags(run.settings, PRESETS), *before_options(run.settings, ours)])


def before_options(recorded, ours):
    """'(before --exponent)' for each option (BEFORE_OPTION) that a run of our kernel did not record (recorded: its
    config and summary, or its runs.csv row): it ran neither value."""
    return [f"(before --{k.replace('_', '-')})" for k in BEFORE_OPTION if ours and recorded.get(k) is None]


def by_arm(runs):
    """{arm: [runs]}, the arms in the order they first appear."""
    groups = {}
    for run in runs:
        groups.setdefault(arm(run), []).append(run)
    return groups


def median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def span(values, spec=",.0f"):
    """'median (low-high)' of numbers; one number where they all read as one; '-' for none."""
    values = sorted(values)
    if not values:
        return "-"
    if format(values[0], spec) == format(values[-1], spec):
        return format(values[0], spec)
    return f"{format(median(values), spec)} ({format(values[0], spec)}-{format(values[-1], spec)})"


def medians(values, unit=""):
    """span's words for a sentence: "300 steps" where the values read as one, else "600 steps, the median
    (300-900)"."""
    words = span(values)
    number, _, rest = words.partition(" ")
    return f"{number}{unit}, the median {rest}" if rest else f"{words}{unit}"


def group_outcome(group):
    """An arm's runs in a few words, several runs' steps as the median (range): "10 runs: 10 collapsed at step
    91,028, the median (52,440-141,554)", "4 runs: no collapse in 150,000 steps, the median (150,000-152,000)", "3
    runs: 1 collapsed at step 300; 1 without a collapse in 390 steps; 1 stopped at step 10, before its end
    (killed)". Run.ended says which."""
    steps = lambda kind: [run.collapse_step if kind == "collapsed" else run.outcome["steps"]
                          for run in group if run.ended == kind]
    collapsed, finished, stopped, running = map(steps, ("collapsed", "finished", "stopped", "running"))
    words = [f"{len(collapsed)} collapsed at step {medians(collapsed)}"] if collapsed else []
    if finished:
        words.append(("no collapse" if len(finished) == len(group) else f"{len(finished)} without a collapse")
                     + f" in {medians(finished, ' steps')}")
    if stopped:
        their = "its" if len(stopped) == 1 else "their"
        words.append(f"{len(stopped)} stopped at step {medians(stopped)}, before {their} end (killed)")
    if running:
        words.append(f"{len(running)} still running (step {medians(running)})")
    return f"{len(group)} run{'s' if len(group) > 1 else ''}: " + "; ".join(words)


# -----------------------------------------------------------------------------
# The headline: per arm, each run's loss and layer 0's max logit to its end, and the share not yet collapsed

MEDIAN_RUNS = 3   # an arm's median is drawn only where all its lines, at least this many, are alive: the median of
                  # two is their midpoint, and a median of the survivors jumps where a run ends, which reads as a recovery


def median_line(group, column):
    """(steps, median) of a log column over the runs of `group`, on the union of their logged steps; each run
    counts within its own logged range (interpolated between its rows), and the median is NaN (not drawn) where
    any run has ended (or not begun). None with fewer than MEDIAN_RUNS runs, or where it is NaN everywhere."""
    series = [s for s in (run.series(column) for run in group) if s is not None]
    if len(series) < MEDIAN_RUNS:
        return None
    steps = np.unique(np.concatenate([x for x, _ in series]))
    values = np.full((len(series), len(steps)), np.nan)
    for row, (x, y) in zip(values, series):
        inside = (steps >= x[0]) & (steps <= x[-1])
        row[inside] = np.interp(steps[inside], x, y)
    enough = np.isfinite(values).all(axis=0)
    if not enough.any():
        return None
    middle = np.full(len(steps), np.nan)
    middle[enough] = np.nanmedian(values[:, enough], axis=0)
    return steps, middle


def survival(group):
    """(steps, share of runs not yet collapsed) of an arm, the Kaplan-Meier estimate over its runs: at each
    collapse the share falls by 1/(runs still training there); a run that ended without collapsing (or stopped)
    leaves the count where it ended, after any collapse at that step (it trained that far). The curve runs from
    step 0 to the arm's last step."""
    ends = sorted(((run.collapse_step if run.collapse_step is not None else run.outcome["steps"],
                    run.collapse_step is not None) for run in group), key=lambda end: (end[0], not end[1]))
    steps, share, alive = [0], [1.0], 1.0
    for i, (step, collapsed) in enumerate(ends):
        if collapsed:
            alive *= 1 - 1 / (len(ends) - i)
            steps.append(step), share.append(alive)
    steps.append(ends[-1][0]), share.append(alive)
    return np.array(steps), np.array(share)


def plot_headline(runs, study, path, title):
    """Per arm, train loss and layer 0's max logit of each run with a log: a thin line to its end, an X where it
    collapsed, and the median where all of them, at least MEDIAN_RUNS, are alive; then the share of the arm's runs not yet
    collapsed, over `study`: the runs and every other run of their studies (runs.csv rows without a log), so that
    the panel and the legend count what the table counts. Each arm in its own hue (nanolp.plots.arm_hues),
    labelled with its command; the axes end at the last step drawn."""
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), width_ratios=[1, 1, 0.8])
    drawn, groups = by_arm(runs), by_arm(study)
    hues = arm_hues({name: family(group[0]) for name, group in groups.items()})
    max_step = max(run.outcome["steps"] for run in study)
    handles, medians_drawn = [], False
    for name, group in groups.items():
        colour = hues[name]
        lines = drawn.get(name, [])
        # the fix on top of every other arm, its lines wider; the fp32 control dashed and beneath them: both train
        # where the controls do, and the fix is what the figure shows
        style = {"fp32": dict(linestyle="--", zorder=1), "fix on": dict(zorder=3)}.get(family(group[0]), dict(zorder=2))
        width = 1.5 if family(group[0]) == "fix on" else 0.8
        for ax, column in zip(axes, ("train_loss", LOGIT)):
            for run in lines:
                if run.series(column) is not None:
                    ax.plot(*run.series(column), color=colour, linewidth=width, alpha=0.75, **style)
                mark_collapse(ax, run, column, colour)
            curve = median_line(lines, column)
            if curve is not None:
                ax.plot(*curve, color=colour, linewidth=2.6, **style)
                medians_drawn = True
        steps, share = survival(group)
        # a tick where each run ended without a collapse; shorter arms drawn over longer ones, so that arms that
        # never collapsed, all at 1, each show where they end
        axes[2].step(steps, share, where="post", color=colour, linewidth=1.6, linestyle=style.get("linestyle", "-"),
                     zorder=style["zorder"] + 1 - steps[-1] / max_step)
        ended = [run.outcome["steps"] for run in group if run.collapse_step is None]
        axes[2].plot(ended, share[np.searchsorted(steps, ended, side="right") - 1], "|", color=colour,
                     markersize=14, markeredgewidth=1.6, zorder=4)
        logs = "" if len(lines) == len(group) else f"; lines: {len(lines)} of them" if lines else "; no lines"
        handles.append(Line2D([], [], color=colour, linewidth=1.6, linestyle=style.get("linestyle", "-"),
                              label=f"{command(name)}: {group_outcome(group)}{logs}"))
    if medians_drawn:
        handles.append(Line2D([], [], color="gray", linewidth=2.6,
                              label=f"median of an arm's lines, while all of them (at least {MEDIAN_RUNS}) are alive"))
    if any(run.collapse_step is not None for run in runs):
        handles.append(Line2D([], [], color="w", marker="X", markeredgecolor="k", markersize=9, label="collapse"))
    handles.append(Line2D([], [], color="k", marker="|", linestyle="", markersize=12,
                          label="a run's end without a collapse (right)"))
    titles = ("training loss (nats/token)", f"layer {PROBE_LAYER}'s max attention logit",
              "share of runs not yet collapsed" + (" (all of runs.csv)" if len(study) > len(runs) else ""))
    for ax, text in zip(axes, titles):
        ax.set_title(text)
        ax.set_xlabel("step")
        ax.set_xlim(0, 1.02 * max_step)   # (a margin for the end ticks, which sit on the last step)
        step_axis(ax.xaxis)
        ax.grid(alpha=0.3, which="both")
    for ax in axes[:2]:
        ax.set_yscale("log")
    axes[2].set_ylim(-0.03, 1.03)
    fig.suptitle(f"{title}: per command, each run with a kept log a thin line to its end", fontsize=11)
    fig.tight_layout()
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=9)
    return save(fig, path)


def mark_collapse(ax, run, column, colour):
    """An X on the run's curve where summary.json says it collapsed."""
    series = run.series(column)
    if run.collapse_step is None or series is None:
        return
    ax.plot([run.collapse_step], [np.interp(run.collapse_step, *series)], marker="X", markersize=10, color=colour,
            markeredgecolor="k", zorder=5)


# -----------------------------------------------------------------------------
# Where W_Q grows: the layer whose spectral norm grows most picks the per-head figure


def growth_layer(runs):
    """The layer whose sn_q grows most relative to its value at the first logged step.

    Growth of one run's layer = max over logged steps / first logged value, averaged over the `--fix off` runs
    of our attention (the failing configuration), or over all runs if there are none.
    Returns (layer or None, {layer: mean growth}).
    """
    chosen = [run for run in runs if family(run) == "fix off"] or runs
    growth = {}
    for run in chosen:
        for column in run.columns(r"sn_q_L\d+"):
            series = run.series(column)
            if series is not None and series[1][0] > 0:
                growth.setdefault(int(column[len("sn_q_L"):]), []).append(series[1].max() / series[1][0])
    mean = {layer: float(np.mean(values)) for layer, values in growth.items()}
    return (max(mean, key=mean.get) if mean else None), mean


GROWTH_MARGIN = 2   # while a model learns, every layer's W_Q grows alike (a 300-step tiny run: 1.8x and 2.1x); a
                    # runaway grows one layer's far past the others' (the seed study's fix off: 329x against <= 8.8x)


def stands_out(layer, growth):
    """Whether `layer`'s growth ({layer: growth}) is at least GROWTH_MARGIN times every other layer's: only then
    does the report name it as the layer where W_Q grows."""
    others = [g for i, g in growth.items() if i != layer]
    return bool(others) and growth[layer] >= GROWTH_MARGIN * max(others)


def layer_count(runs):
    return max((len(run.columns(r"max_logit_L\d+")) for run in runs), default=0)


def head_count(runs, layer):
    return max((len(run.columns(rf"sn_q_L{layer}_H\d+")) for run in runs), default=0)


# -----------------------------------------------------------------------------
# The report's tables: per run, then per arm (rates.csv); analyze_runs draws the figures and writes them

def peak_logit(run):
    series = run.series(LOGIT)
    return None if series is None else float(series[1].max())


ENDED = dict(finished="no", running="no, still running", stopped="no, but stopped before its end (killed)")


def run_table(runs):
    lines = [f"| run | arm | seed | steps | collapsed | final train loss | final val loss | peak {LOGIT} "
             "| tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        collapsed = ENDED.get(run.ended) or (f"step {run.collapse_step:,}, "
                                             f"{fmt(run.summary.get('collapse_minute'), '.1f')} min")
        cells = [f"`{run.path}`", f"`{arm(run)}`", run.setting("seed", "n/a"),
                 fmt(run.outcome["steps"], ","), collapsed, fmt(run.outcome.get("final_train_loss"), ".4f"),
                 fmt(run.outcome["final_val_loss"], ".4f"),
                 fmt(peak_logit(run), ".3g"), fmt(run.outcome["tokens_per_s"], ",.0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


ALIKE = ("preset", "data", "lr", "pos", "qk_norm")   # the settings a run shares with the fp32 arm it is set against


def arm_rates(runs):
    """One row per arm, in the order the arms first appear: how many of its runs collapsed among those that ended
    by themselves (a collapse, or their --steps or --minutes), how many did not end so (killed, or still running:
    they have not said), the median minutes to collapse over the collapsed, medians over all of its runs, and its
    val loss against that of fp32 attention trained alike (val_loss_vs; ALIKE: at the same lr, say)."""
    groups = by_arm(runs)
    alike = lambda group: [run.setting(key) for run in group[:1] for key in ALIKE]
    fp32 = [group for group in groups.values() if all(family(run) == "fp32" for run in group)]
    rows = []
    for name, group in groups.items():
        collapsed = [run for run in group if run.ended == "collapsed"]
        reference = next((ref for ref in fp32 if alike(ref) == alike(group)), None)
        step, ratio = val_loss_vs(group, reference) if reference else (None, None)
        rows.append(dict(arm=name, collapsed=len(collapsed), runs=len(group),
                         ended=sum(run.ended in ("collapsed", "finished") for run in group),
                         median_collapse_minute=median([run.summary.get("collapse_minute") for run in collapsed]),
                         **{f"median_{key}": median([run.outcome[key] for run in group])
                            for key in ("steps", "final_val_loss", "max_logit", "tokens_per_s")},
                         val_step=step, val_loss_vs_fp32=ratio))
    return rows


def val_loss_vs(group, reference):
    """The median val loss of `group` over the reference arm's (fp32 attention), both at the last step where every
    run of either logged one (the model memorises the text, so val loss is compared at one step, not at the
    end); (step, ratio), or (None, None) without such a step."""
    curves = [(run, run.series("val_loss")) for run in group + reference]
    if any(curve is None for _, curve in curves):
        return None, None
    common = set.intersection(*(set(curve[0].tolist()) for _, curve in curves))
    if not common:
        return None, None
    step = max(common)  # a run's final evaluation falls between the others' regular ones
    at_step = {run.path: float(curve[1][curve[0] == step][0]) for run, curve in curves}
    return int(step), median([at_step[r.path] for r in group]) / median([at_step[r.path] for r in reference])


def rate_table(rates):
    lines = ["| arm | collapsed / ended | killed or running | median minutes to collapse | median steps "
             "| median final val loss | median max logit | median tokens/s | val loss / fp32's (at step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rates:
        versus = "-" if r["val_loss_vs_fp32"] is None else f"{r['val_loss_vs_fp32']:.4f} ({r['val_step']:,})"
        cells = [f"`{r['arm']}`", f"{r['collapsed']}/{r['ended']}", str(r["runs"] - r["ended"]),
                 fmt(r["median_collapse_minute"], ".1f") if r["collapsed"] else "-",
                 fmt(r["median_steps"], ",.0f"), fmt(r["median_final_val_loss"], ".4f"),
                 fmt(r["median_max_logit"], ".4g"), fmt(r["median_tokens_per_s"], ",.0f"), versus]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def analyze_runs(runs, out):
    """The headline and the per-layer figures into `out`; returns the report section as markdown lines. A study's
    runs (STUDY/runs/NAME, beside STUDY/runs.csv) come with the study's other runs, those whose logs were not kept,
    for the counts that the table makes (the headline's survival panel and legend)."""
    where = lambda run: run.path.resolve()   # a run or a table given in two spellings (relative, absolute) is one
    tables = {}
    for table in sorted(run.path.parent.parent / "runs.csv" for run in runs if run.path.parent.name == "runs"):
        if table.exists():
            tables.setdefault(table.resolve(), table)
    tables = list(tables.values())
    rows = {table: table_rows([table]) for table in tables}   # (before study_runs: refused in a line, if at all)
    logged = {where(run): run for run in runs}
    study = [logged.get(where(run), run) for table in tables for run in study_runs(table)]
    in_study = {where(run) for run in study}
    study += [run for run in runs if where(run) not in in_study]
    styles = run_styles(runs, {run.path: arm(run) for run in runs})
    # the headline: the kernel as it ships, README's table; the earlier kernels' runs in a figure of their own
    shipped = {where(run) for run in study if as_shipped({**run.config, **run.summary})}
    figures = [plot_headline([run for run in runs if where(run) in keep], [run for run in study if where(run) in keep],
                             out / name, title)
               for keep, name, title in ((shipped, "headline.png", "the kernel as it ships"),
                                         ({where(run) for run in study} - shipped, "headline_earlier_kernels.png",
                                          "the earlier kernels, whose exponent the compiler fused in part"))
               if keep]
    figures.append(plot_grid(   # (a val loss that rises while the train loss falls: the text memorised)
        runs, styles, [["train_loss", "val_loss"]], "training and validation loss", "nats per character",
        out / "loss.png"))
    layers = range(layer_count(runs))
    layer, growth = growth_layer(runs)
    if layers:
        figures.append(plot_grid(
            runs, styles, [[f"max_logit_L{i}" for i in layers]], "max attention logit per layer",
            "max scaled logit q.k/sqrt(d)", out / "max_logit.png"))
        figures.append(plot_grid(
            runs, styles, [[f"sn_q_L{i}" for i in layers], [f"sn_k_L{i}" for i in layers]],
            "spectral norm of W_Q (top) and W_K (bottom) per layer", "spectral norm", out / "spectral_norm.png"))
    if layer is not None and head_count(runs, layer):
        figures.append(plot_grid(
            runs, styles, [[f"sn_q_L{layer}_H{h}" for h in range(head_count(runs, layer))]],
            f"spectral norm of W_Q per head in layer {layer}, where sn_q grows most",
            "spectral norm", out / "spectral_norm_heads.png"))
    if layers:
        figures.append(plot_grid(
            runs, styles, [[f"tie_rate_L{i}" for i in layers], [f"sharp_rate_L{i}" for i in layers]],
            f"tie rate: rows with >= 2 scores within 2^{np.log2(TIE_TOL):.0f} of the row max; below, sharp rate: "
            f"rows whose largest P exceeds 1 - {SHARP_EPS:g}", "fraction of rows", out / "tie_rate.png"))
        figures.append(plot_grid(
            runs, styles, [[f"delta_err_L{i}" for i in layers], [f"delta_push_L{i}" for i in layers]],
            "cumulative signed delta error (top) and its push on |W_Q|^2 + |W_K|^2 (bottom), summed over logged steps",
            "cumulative sum", out / "delta_err.png", transform=np.cumsum))

    rates = arm_rates(runs)
    write_csv(out / "rates.csv", rates, list(rates[0]))
    lines = ["## Runs", ""]
    tiny = [run.name for run in runs if run.setting("preset", "default") == "tiny" and not run.summary.get("collapsed")]
    if tiny:   # a CPU smoke run: its flat logits are no result (as train.py says at its end)
        lines += [f"{', '.join(tiny)}: {TINY_NOTE}.", ""]
    for table in tables:   # a study's runs: results/README.md's table, the rows of runs whose logs were not kept too
        lines += [f"All runs of `{table}`, by arm (`python analyze.py --table {table}` writes it into the docs whose "
                  "table marker names that file):", ""] + study_table(rows[table]) + [""]
    lines += (["The runs with logs:", ""] if tables else []) + run_table(runs) + ["", "### Per arm", ""]
    lines += ["Medians over each arm's runs (max logit: over all layers), minutes to collapse over its collapsed runs "
              "only; a run ended by itself in a collapse or at its --steps or --minutes. Also in rates.csv.",
              ""] + rate_table(rates)
    lines += ["", "### Where W_Q grows", ""]
    if layer is None:
        lines.append("No sn_q columns with data: growth layer not determined.")
    else:
        verdict = (f"Largest, at least {GROWTH_MARGIN}x every other layer's: **layer {layer}** (per head: "
                   f"spectral_norm_heads.png)." if stands_out(layer, growth) else
                   f"No layer stands out: none grew {GROWTH_MARGIN}x as much as every other, as in a run that only "
                   f"learned (per head, layer {layer}, the largest: spectral_norm_heads.png).")
        lines.append("Growth of sn_q = max over logged steps / value at the first logged step, mean over the "
                     "`--fix off` runs of our attention (all runs if there are none): " + ", ".join(
                         f"L{i} {g:.3g}" for i, g in sorted(growth.items())) + ". " + verdict)
    return lines + ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]


# -----------------------------------------------------------------------------
# The study's table: runs.csv by arm, written into README.md between markers, so it is never typed

ALONE_PACE = 8000   # steps a minute: a default-preset run of our kernel faster than this had the H200 alone from
                    # start to end (8,086-10,529 in the seed and stochastic-rounding studies; beside another run for
                    # all or part of its steps at most 7,344; its tokens/s, a median over log rows, misses the part)
ALONE_GPU = "NVIDIA H200"   # the card of README's minutes (runs.csv's gpu): an H100's minutes are not an H200's;
                            # a row without one (its summary gone) is from before the runs met any other card
RUNAWAY_LOGIT = 1e4   # a max logit past this ran away: the seed study's arms whose logits stay flat (fp32
                      # attention, delta from P or the fp32 O, the fix) peak at 65-242 over all layers
DOCS = ("README.md", "results/README.md", "docs/findings.md")   # where --table's tables go, between their markers


def command(name):
    """An arm's train.py command as the table gives it: the flags, less an earlier kernel's "(before --...)"."""
    return "python train.py " + name.split(" (before")[0]


def seed_list(seeds):
    seeds = sorted(set(seeds))
    if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)):
        return f"{seeds[0]}-{seeds[-1]}"
    return ", ".join(map(str, seeds))


def rows_by_arm(rows):
    """A study's runs.csv rows (nanolp.runs.study_rows) by arm, in the order the arms first appear, less the rows
    of patched kernels (no train.py command: results/README.md has those). Our kernel's runs from before an option
    (BEFORE_OPTION) stand apart, under "ARM (before --OPTION)", as arm() labels them in the figures; so do two
    studies' arms of one name and other flags, the second under "ARM (FLAGS)"."""
    arms = {}
    for row in rows:
        if not row.get("variant"):
            name = " ".join([row["arm"], *before_options(row, row.get("attn") in OURS)])
            if name in arms and arms[name][0]["flags"] != row["flags"]:
                name += f" ({row['flags']})"
            arms.setdefault(name, []).append(row)
    return arms


def quoted(name):
    """An arm's name (rows_by_arm) as a table shows it: `paper`, `paper` (before --exponent)."""
    arm, label = name.split(" (", 1) if " (" in name else (name, "")
    return f"`{arm}`" + (f" ({label}" if label else "")


def readme_order(arms):
    """README's order of rows_by_arm's arms: the fix off, then the fix on (the two commands README is about), then
    the others as they first appear."""
    first = ("--fix off", "--fix on")
    rank = lambda item: first.index(item[1][0]["flags"]) if item[1][0]["flags"] in first else len(first)
    return dict(sorted(arms.items(), key=rank))


def alone_minutes(group, kin=()):
    """Each run's minutes to its collapse (or its end) alone on the H200: its own where it had an H200 alone, else
    its steps at the median pace of the arm's runs that did, or where none did, of the runs of kin (kin_of: the
    fix trains at fix off's pace, results/speed/train_speed.txt); None where none of either did."""
    end = lambda row: (row["collapse_step"], row["collapse_minute"]) if row["collapsed"] else (row["steps"],
                                                                                                row["minutes"])
    had_it = lambda row: (row.get("gpu") or ALONE_GPU) == ALONE_GPU and end(row)[0] / end(row)[1] > ALONE_PACE
    alone = [row for row in group if had_it(row)]
    if not alone:
        alone = [row for row in kin if had_it(row)]
    if not alone:
        return None
    pace = median([end(row)[0] / end(row)[1] for row in alone])
    return [end(row)[1] if row in alone else end(row)[0] / pace for row in group]


def kin_of(group, rows):
    """The rows that train at an arm's pace: the same attention and block (rotary positions and QK-norm cost a step
    12-18%: rope-s0 and qk-norm-s0 trained 8,690 and 8,360 steps a minute alone, the fix's runs that had the GPU
    alone 9,900-10,200; runs.csv's steps over minutes), the same model and batch, and no patched kernel."""
    keys = ("attn", *GPT2_BLOCK, "n_layer", "n_embd", "batch_size", "block_size")
    return [row for row in rows if all(row.get(key) == group[0].get(key) for key in keys) and not row.get("variant")]


TABLE_COLUMNS = STUDY_COLUMNS + ("minutes", "collapse_minute", "max_logit")   # what the tables read of each row


def table_rows(tables):
    """The rows of one or more studies' runs.csv, each with its study's `folder` (nanolp.runs.study_rows); a table
    that cannot be one of them, or lacks a column the blocks read, is refused in one line."""
    try:
        return study_rows(tables, TABLE_COLUMNS)
    except ValueError as e:
        fail(str(e))


def kept_peaks(group):
    """Layer 0's peak max logit in each run of the group (table_rows) whose log is kept."""
    return [peak_logit(run) for run in load_runs(row["run_dir"] for row in group if row.get("log_kept"))]


def shipped_commands(rows):
    """The commands of the kernel as it ships (as_shipped) among rows (table_rows), in README's order: per command
    its rows, the steps of those that collapsed, and their minutes alone on the H200 (alone_minutes; None)."""
    shipped = [row for row in rows if as_shipped(row)]
    if not shipped:
        fail("no run of the kernel as it ships among these tables' rows: README's table and commands are of those")
    return [(group, [row["collapse_step"] for row in group if row["collapsed"]],
             alone_minutes(group, kin_of(group, shipped)))
            for group in readme_order(rows_by_arm(shipped)).values()]


def shipped_table(rows):
    """README's table: one line per train.py command of the runs of the kernel as it ships (as_shipped) among rows
    (table_rows), in README's order (readme_order): its runs, how many collapsed, at which step (or how long they ran
    without one), the minutes that takes alone on the H200 (alone_minutes) and layer 0's peak (from the kept
    logs)."""
    lines = ["| command | runs (seeds) | collapsed | steps: to the collapse, or run without one | minutes alone on "
             f"an H200 | peak of {LOGIT} |", "|---|---|---|---|---|---|"]
    for group, fell, minutes in shipped_commands(rows):
        stood = [row["steps"] for row in group if not row["collapsed"]]
        steps = ([span(fell)] if fell else []) + ([f"{span(stood)}, no collapse"] if stood else [])
        cells = [f"`python train.py {group[0]['flags']}`", f"{len(group)} ({seed_list(row['seed'] for row in group)})",
                 f"**{len(fell)} / {len(group)}**", "; ".join(steps), "-" if minutes is None else span(minutes, ".1f"),
                 span(kept_peaks(group), ".3g")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", f"Each number is the median of the runs (of two, their midpoint), the range in brackets. "
                        f"Minutes alone: a run's own where it had an H200 to itself (over {ALONE_PACE:,} steps a "
                        f"minute, our kernel's pace alone), else its steps at the pace of its command's runs that did, "
                        f"or where none did, of the other commands' runs of the same attention and block that did; "
                        f"`-` where none did (fp32 attention, under that pace even alone)."]


def run_lines(rows):
    """README's "Run it" lines of the table's commands: what each did, and in how many minutes alone."""
    lines, commands = [], shipped_commands(rows)
    width = max(len(group[0]["flags"]) for group, _, _ in commands) + len("python train.py ") + 1   # comments aligned
    for group, fell, minutes in commands:
        seeds = f"{len(group)} seed{'s' * (len(group) > 1)}"
        what = (f"collapsed on {len(fell)} of {seeds}" if fell else
                f"no collapse on {seeds} in {span([row['steps'] for row in group])} steps")
        when = "" if minutes is None else f", {between(minutes)} min alone on an H200"
        lines.append(f"    {'python train.py ' + group[0]['flags']:<{width}}# {what}{when}")
    return lines


def between(values, spec=".1f"):
    """'low-high' of numbers, or one number where both read the same."""
    low, high = format(min(values), spec), format(max(values), spec)
    return low if low == high else f"{low}-{high}"


def study_table(rows):
    """The markdown table of all of a study's runs.csv rows (table_rows), one line per arm in the order the arms
    first appear, a line on the arms that ran away without a collapse, and one on how long the fix-off arms take to
    collapse alone on the GPU. The peak max logit over all layers is every row's (runs.csv's max_logit), layer 0's
    comes from the runs whose logs are kept."""
    arms, variants = rows_by_arm(rows), [row for row in rows if row.get("variant")]
    lines = ["| arm | command | runs (seeds) | logs kept | collapsed | steps to collapse: median (range) "
             "| steps without a collapse: median (range) | training minutes to collapse | peak max logit, any layer "
             f"| peak of {LOGIT} (kept logs) |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, group in arms.items():
        fell = [row for row in group if row["collapsed"]]
        stood = [row for row in group if not row["collapsed"]]
        cells = [quoted(name), f"`python train.py {group[0]['flags']}`",
                 f"{len(group)} ({seed_list(row['seed'] for row in group)})",
                 str(sum(bool(row.get("log_kept")) for row in group)), f"**{len(fell)} / {len(group)}**",
                 span([row["collapse_step"] for row in fell]), span([row["steps"] for row in stood]),
                 span([row["collapse_minute"] for row in fell], ".1f"),
                 span([row["max_logit"] for row in group if row["max_logit"] is not None], ".3g"),
                 span(kept_peaks(group), ".3g")]
        lines.append("| " + " | ".join(cells) + " |")
    if variants:
        lines += ["", f"Not in the table: {len(variants)} runs of patched kernels (runs.csv's `variant` column)."]
    quiet = {name: group for name, group in arms.items() if not any(row["collapsed"] for row in group)}
    high = {name: [row for row in group if (row["max_logit"] or 0) > RUNAWAY_LOGIT] for name, group in quiet.items()}
    ran_away = {name: high_rows for name, high_rows in high.items() if high_rows}
    if ran_away:   # "0 / 4" beside "10 / 10" reads as "stays flat"; these ran away and had not collapsed yet
        flat = [row["max_logit"] for name, group in quiet.items() if name not in ran_away for row in group
                if row["max_logit"] is not None]
        lines += ["", f"No collapse is not no runaway: the max logit passed {RUNAWAY_LOGIT:,.0f} in " + ", ".join(
            f"{len(high_rows)} of the {len(arms[name])} runs of {quoted(name)}"
            for name, high_rows in ran_away.items()) +
            ", which ended at the steps above before a collapse" + (
            f"; the other arms without a collapse peak at {max(flat):.3g}." if flat else ".")]
    for name, group in arms.items():
        off = [row for row in group if row["collapsed"] and row["flags"] == "--fix off"]
        minutes = alone_minutes(off) if off else None
        if minutes is not None:   # steps a minute of the runs that had the GPU alone, evaluations included
            lines += ["", f"Alone on one H200 the fix-off runs of {quoted(name)} would collapse after "
                          f"{span(minutes, '.1f')} minutes (alone_minutes)."]
    return lines


def lr_table(rows):
    """The learning-rate curve's points (experiments.lr_curve) as a small table: a row per lr, a column per arm."""
    try:
        points = lr_curve.curve_points(rows)
    except ValueError as e:   # (a kept log that cannot be read)
        fail(str(e))
    if not points:
        fail(f"no run of {', '.join(lr_curve.ARMS)} as it ships among these tables' rows: the by-lr table is of those")
    return lr_curve.markdown(points)


def loss_table(rows):
    """Whether the runs had memorised their text when they collapsed: per run whose log is kept, its lowest train and
    val loss (a memorised text: a train loss near 0, the val loss lowest long before the collapse), and the layer
    whose max logit ran highest; `-` where its log has none of a column."""
    lines = ["| run | collapsed at step | lowest train loss | lowest val loss (its step) | layer whose max logit "
             "peaked highest (peak) |", "|---|---|---|---|---|"]
    for row in rows:
        if not row.get("log_kept") or not (runs := load_runs([row["run_dir"]])):   # a damaged run: named by load_runs
            continue
        run = runs[0]
        train, val = run.series("train_loss"), run.series("val_loss")
        peaks = {int(column[len("max_logit_L"):]): series[1].max()
                 for column in run.columns(r"max_logit_L\d+") if (series := run.series(column)) is not None}
        layer = max(peaks, key=peaks.get, default=None)
        cells = [f"`{row['name']}` (`{row['flags']}`)",
                 f"{row['collapse_step']:,}" if row["collapsed"] else f"none in {row['steps']:,}",
                 "-" if train is None else f"{train[1].min():.3f}",
                 "-" if val is None else f"{val[1].min():.3f} ({val[0][val[1].argmin()]:,.0f})",
                 "-" if layer is None else f"{layer} ({peaks[layer]:.3g})"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


BLOCKS = {"table": shipped_table, "all runs": study_table, "commands": run_lines, "by lr": lr_table,
          "losses": loss_table}


def is_runs_table(path):
    """Whether path is a study's runs.csv: a file whose first line names the columns name, arm and flags."""
    try:
        with open(path) as f:
            header = f.readline().strip().split(",")
    except (OSError, UnicodeDecodeError):
        return False
    return {"name", "arm", "flags"} <= set(header)


def update_docs(root, tables):
    """Replace the lines between each marker of these runs.csv in DOCS (<!-- KIND: python analyze.py --table
    CSV [CSV ...] --> ... <!-- end of KIND -->, KIND a key of BLOCKS) with that block, regenerated from their rows:
    one table of several studies' runs where a marker names several."""
    rows, found, named = table_rows(tables), {}, " ".join(map(str, tables))
    for doc in map(root.joinpath, DOCS):   # every doc's blocks made before any is written: all or none
        text = doc.read_text() if doc.exists() else ""
        for kind, block in BLOCKS.items():
            begin, end = f"<!-- {kind}: python analyze.py --table {named} -->", f"<!-- end of {kind} -->"
            if begin in text:
                parts = text.split(begin)
                for part in parts[1:]:   # its end marker must be the next marker: else the text between would go
                    if part.find("<!--") != part.find(end) or end not in part:
                        fail(f"{doc.relative_to(root)}: the block {begin} has no {end} before the next marker: add "
                             f"it where the block's table ends")
                lines = "\n".join(block(rows))
                text = parts[0] + "".join(begin + "\n" + lines + "\n" + end + part.split(end, 1)[1]
                                          for part in parts[1:])
                found[doc] = text
    for doc, text in found.items():
        changed = text != doc.read_text()
        doc.write_text(text)
        print(f"{doc.relative_to(root)}: the blocks of {named} {'rewritten' if changed else 'regenerated, no change'}")
    if not found:
        fail(f"no block of {named} in {', '.join(DOCS)}: add a line <!-- table: python analyze.py --table {named} "
             f"--> and <!-- end of table --> where it goes")


# -----------------------------------------------------------------------------
# The delta probe (nanolp/probe.py): is delta's error the curvature term tr(H Sigma_e)?


def analyze_probe(runs, out):
    runs = [run for run in runs if run.series(probe.column("total")) is not None]
    if not runs:
        fail(f"no run with the probe's columns ({probe.column('total')}, ...)")
    if all(probe.reference_logit(run) is None for run in runs):   # (a tiny run, say: nothing to pool)
        fail(f"no run with the probe reaches step {probe.REFERENCE_STEP:,}, where its phases start: "
             f"{', '.join(run.name for run in runs)}")
    return probe.report(runs, arm, out)


# -----------------------------------------------------------------------------
# The report file holds one section per mode; each run of analyze.py replaces its own section.


def update_report(path, section):
    """Write `section` (markdown lines starting with a '## ' heading) into report.md, replacing
    the section of the same heading where it stands (appending it if there is none) and keeping
    the others."""
    text = path.read_text() if path.exists() else "# nanolp report\n"
    parts = [part.strip("\n") for part in text.split("\n## ")]
    title, others = parts[0], ["## " + part for part in parts[1:]]
    new = "\n".join(section)
    headings = [part.split("\n")[0] for part in others]
    if section[0] in headings:  # in place, so that the order of the sections stays as it was
        others[headings.index(section[0])] = new
    else:
        others.append(new)
    path.write_text("\n\n".join([title] + others) + "\n")


def fail(message):
    """A command that cannot run, refused as its flags are (nanolp.cli.Parser): one line, exit status 2."""
    Parser(prog="analyze.py").error(message)


def main(argv=None):
    parser = Parser(prog="analyze.py", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("runs", nargs="*",
                        help=f"run folders, or folders of them (default: {PRESETS['default']['out']}/)")
    parser.add_argument("--out", type=Path, help="where figures and report.md go (default: <runs root>/figures)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--probe", action="store_true", help="the delta probe's columns of the runs")
    mode.add_argument("--mechanism", action="store_true", help="the rounding bias on synthetic rows; no runs")
    mode.add_argument("--table", type=Path, nargs="+", metavar="CSV",
                      help="rewrite the tables of a study's runs.csv (or of several studies', in one table) in "
                           "README.md, results/README.md and docs/findings.md (between their markers); no runs")
    args = parser.parse_args(argv)
    if (args.mechanism or args.table) and args.runs:
        parser.error(f"--{'mechanism' if args.mechanism else 'table'} reads no runs")
    if args.table and args.out:
        parser.error("--table writes the docs' tables in place: no --out")
    given = args.table if args.table else [] if args.mechanism else args.runs or [PRESETS["default"]["out"]]
    missing = [str(path) for path in given if not Path(path).exists()]
    if missing:   # one line, not a traceback
        fail(f"no such file or folder: {', '.join(missing)}")
    if args.table:
        others = [path for path in args.table if not is_runs_table(path)]
        if others:
            fail(f"not a study's runs.csv (a CSV with columns name, arm and flags): {', '.join(map(str, others))}")
        return update_docs(Path(__file__).resolve().parent, args.table)

    paths = [] if args.mechanism else find_runs(given)
    if not args.mechanism and not paths:
        fail(f"no run folders (with a log.csv or log.csv.gz) in {', '.join(given)}")
    root = Path(os.path.commonpath([p.parent.absolute() for p in paths])) if paths else Path(PRESETS["default"]["out"])
    out = args.out or root / "figures"
    runs = load_runs(paths)   # (one with a damaged file: left out, in one line)
    if paths and not runs:
        fail(f"no readable runs in {', '.join(given)}: every one was left out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a file of that name, or a folder that cannot be written
        fail(f"--out must be a folder: cannot make {out} ({e.strerror})")

    if args.mechanism:
        section = demonstrate(out)
    elif args.probe:
        section = analyze_probe(runs, out)
    else:
        section = analyze_runs(runs, out)
    update_report(out / "report.md", section)
    print(f"wrote {out / 'report.md'} and figures in {out}")


if __name__ == "__main__":
    main()
