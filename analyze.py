"""The last chapter: what the runs show, in figures and a short report, and the rounding bias without training.

    python analyze.py RUN... --out DIR           headline.png (loss and layer 0's max logit per arm), per-layer
                                                 figures, rates.csv (per arm: collapsed, medians)
    python analyze.py --probe RUN... --out DIR   delta_probe.png: the probe's terms, pooled before the runaway
    python analyze.py --mechanism --out DIR      the bias on synthetic rows (CPU, about a minute)

With `--fix off` the backward's delta = rowsum(dO * O) reads the forward's O after its final bf16 cast. The char
model memorises its text within ~20,000 steps and then trains on near-zero gradients; from there the error that
cast puts into delta keeps one sign in layer 0, and it reaches W_Q through dS = P * (dP - delta) the same way at
every step. Layer 0's W_Q grows (spectral_norm.png), its logits run away (headline.png) and the loss collapses.
`--fix on`, the paper's shifted row max plus delta from the forward's fp32 O, keeps layer 0 flat. The paper's rule
alone (`--fix paper`) removes the bias of rows with several tied maxima (--mechanism's tables), but ties are rare
in layer 0 (tie_rate.png) and it does not stop the runaway.
Why one sign, when round-to-nearest has none? On synthetic sharp rows the cast drops the other keys' pull, which
is one-signed where dO points along it (results/mechanism/sharp_rows.txt, tests/test_mechanism.py). A second
candidate, a hypothesis the data have not confirmed: dO is computed downstream of the rounded O, so it is
correlated with the rounding error e, and the mean of rowsum(dO * e) is tr(H Sigma_e) > 0 near a minimum, H the
loss's curvature in O. On a loss with known H that holds exactly (--mechanism's curvature.png); in the model the
probe finds the term positive early but below the noise of delta's error, and negative later (delta_probe.png).

Runs are named by their arm: the train.py flags that set them apart from their preset.
"""

import argparse
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

from nanolp.diagnostics import PROBE_LAYER, PROBE_TERMS
from nanolp.mechanism import demonstrate
from nanolp.plots import THOUSANDS, family, fix_word, plot_grid, run_styles, save
from nanolp.runs import find_runs, load_run
from nanolp.sweep import write_csv
from nanolp.presets import COMMON, NUMERICS, PRESETS, changed_settings

# -----------------------------------------------------------------------------
# Arms: a run is named by the train.py flags that set it apart from its preset

OURS = ("kernel", "emulate")  # the attentions that take --fix and the numerics (nanolp.presets.NUMERICS)


def arm(run):
    """The flags, e.g. "--fix off", "--fix on --lr 0.003", "--attn sdpa": --preset and --attn where they are not
    the default, --fix for our attention, then nanolp.presets.changed_settings (the settings of ARM that differ from
    the preset), less the kernel's options for the torch attentions, which ignore them. A setting an older run
    did not record reads as its default."""
    preset = run.setting("preset", "default")
    settings = {**COMMON, **PRESETS.get(preset, {}), **run.config,
                **{k: v for k, v in run.summary.items() if v is not None}, "preset": preset}
    ours = settings["attn"] in OURS
    flags = ([] if preset == "default" else [f"--preset {preset}"]) + (
        [] if settings["attn"] == COMMON["attn"] else [f"--attn {settings['attn']}"]) + (
        [f"--fix {fix_word(run)}"] if ours else [])
    changed = changed_settings(settings)
    return " ".join(flags + [flag_text(k, v) for k, v in changed.items() if ours or k not in NUMERICS])


def flag_text(key, value):
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):  # train.py's BooleanOptionalAction
        return name if value else name.replace("--", "--no-", 1)
    return f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"


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


def outcome(group):
    """An arm's runs in a few words: "1 seed; no collapse; stopped at 60,000 steps", "8 seeds; 8 collapsed,
    median step 94,395"."""
    collapsed = [run.collapse_step for run in group if run.collapse_step is not None]
    open_steps = sorted(run.steps or 0 for run in group if run.collapse_step is None)
    words = [f"{len(group)} seed{'s' if len(group) > 1 else ''}"]
    if collapsed:
        words.append(f"{len(collapsed)} collapsed, median step {median(collapsed):,.0f}")
    if open_steps:
        reach = f"{open_steps[0]:,}" + (f"-{open_steps[-1]:,}" if open_steps[-1] != open_steps[0] else "")
        words.append(("no collapse; stopped" if not collapsed else f"{len(open_steps)} stopped") + f" at {reach} steps")
    return "; ".join(words)


# -----------------------------------------------------------------------------
# The headline: per arm, the median and the range over seeds of the loss and of layer 0's max logit

LOGIT = f"max_logit_L{PROBE_LAYER}"  # the layer that runs away


def band(group, column):
    """(steps, median, min, max) of a log column over the runs of `group`, on the union of their logged steps;
    each run counts within its own logged range (interpolated between its rows), so a run that stopped early
    drops out of the band there. None if no run has the column."""
    series = [s for s in (run.series(column) for run in group) if s is not None]
    if not series:
        return None
    steps = np.unique(np.concatenate([x for x, _ in series]))
    values = np.full((len(series), len(steps)), np.nan)
    for row, (x, y) in zip(values, series):
        inside = (steps >= x[0]) & (steps <= x[-1])
        row[inside] = np.interp(steps[inside], x, y)
    return steps, np.nanmedian(values, axis=0), np.nanmin(values, axis=0), np.nanmax(values, axis=0)


def plot_headline(runs, styles, path):
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    handles = []
    for name, group in by_arm(runs).items():
        colour = styles[group[0].path]["color"]
        for ax, column in zip(axes, ("train_loss", LOGIT)):
            curve = band(group, column)
            if curve is None:
                continue
            steps, middle, low, high = curve
            ax.plot(steps, middle, color=colour, linewidth=1.4)
            if len(group) > 1:
                ax.fill_between(steps, low, high, color=colour, alpha=0.2, linewidth=0)
            for run in group:
                mark_collapse(ax, run, column, colour)
        handles.append(Line2D([], [], color=colour, linewidth=1.4, label=f"{name} ({outcome(group)})"))
    if any(run.collapse_step is not None for run in runs):
        handles.append(Line2D([], [], color="w", marker="X", markeredgecolor="k", markersize=9, label="collapse"))
    for ax, title in zip(axes, ("training loss (nats/token)", f"layer {PROBE_LAYER}'s max attention logit")):
        ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_formatter(THOUSANDS)
        ax.grid(alpha=0.3, which="both")
    spread = ": median over seeds, shaded min to max" if any(len(g) > 1 for g in by_arm(runs).values()) else ""
    fig.suptitle(f"per arm (the train.py flags that differ from the preset){spread}", fontsize=11)
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


def layer_count(runs):
    return max((len(run.columns(r"max_logit_L\d+")) for run in runs), default=0)


def head_count(runs, layer):
    return max((len(run.columns(rf"sn_q_L{layer}_H\d+")) for run in runs), default=0)


def peak_logit(run):
    series = run.series(LOGIT)
    return None if series is None else float(series[1].max())


def run_table(runs):
    lines = [f"| run | arm | seed | steps | collapsed | final train loss | final val loss | peak {LOGIT} "
             "| tokens/s |", "|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        collapsed = ("n/a (no summary.json)" if not run.summary else "no" if run.collapse_step is None
                     else f"step {run.collapse_step:,}, {fmt(run.summary.get('collapse_minute'), '.1f')} min")
        cells = [f"`{run.path}`", f"`{arm(run)}`", run.setting("seed", "n/a"),
                 fmt(run.steps, ","), collapsed, fmt(run.summary.get("final_train_loss"), ".4f"),
                 fmt(run.final_val_loss, ".4f"),
                 fmt(peak_logit(run), ".3g"), fmt(run.tokens_per_s, ",.0f")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def arm_rates(runs):
    """One row per arm, in the order the arms first appear: how many of its runs collapsed, the median minutes to
    collapse over those, medians over all of its runs, and its val loss against fp32 attention's (val_loss_vs)."""
    groups = by_arm(runs)
    reference = next((g for g in groups.values() if all(family(run) == "fp32" for run in g)), None)
    rows = []
    for name, group in groups.items():
        collapsed = [run for run in group if run.collapse_step is not None]
        step, ratio = val_loss_vs(group, reference) if reference else (None, None)
        rows.append(dict(arm=name, collapsed=len(collapsed), runs=len(group),
                         median_collapse_minute=median([run.summary.get("collapse_minute") for run in collapsed]),
                         **{f"median_{key}": median([getattr(run, key) for run in group])
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
    lines = ["| arm | collapsed | median minutes to collapse | median steps | median final val loss "
             "| median max logit | median tokens/s | val loss / fp32's (at step) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rates:
        versus = "-" if r["val_loss_vs_fp32"] is None else f"{r['val_loss_vs_fp32']:.4f} ({r['val_step']:,})"
        cells = [f"`{r['arm']}`", f"{r['collapsed']}/{r['runs']}",
                 fmt(r["median_collapse_minute"], ".1f") if r["collapsed"] else "-",
                 fmt(r["median_steps"], ",.0f"), fmt(r["median_final_val_loss"], ".4f"),
                 fmt(r["median_max_logit"], ".4g"), fmt(r["median_tokens_per_s"], ",.0f"), versus]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def analyze_runs(runs, out):
    """The headline and the per-layer figures into `out`; returns the report section as markdown lines."""
    styles = run_styles(runs, {run.path: arm(run) for run in runs})
    figures = [plot_headline(runs, styles, out / "headline.png")]
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
            "tie rate: rows with >= 2 scores within TIE_TOL of the row max; below, sharp rate: rows whose "
            "largest P exceeds 1 - 1e-3", "fraction of rows", out / "tie_rate.png"))
        figures.append(plot_grid(
            runs, styles, [[f"delta_err_L{i}" for i in layers], [f"delta_push_L{i}" for i in layers]],
            "cumulative signed delta error (top) and its push on |W_Q|^2 + |W_K|^2 (bottom), summed over logged steps",
            "cumulative sum", out / "delta_err.png", transform=np.cumsum))

    rates = arm_rates(runs)
    write_csv(out / "rates.csv", rates, list(rates[0]))
    lines = ["## Runs", ""] + run_table(runs) + ["", "### Per arm", ""]
    lines += ["Medians over each arm's runs (max logit: over all layers), minutes to collapse over its collapsed runs "
              "only. Also in rates.csv.", ""] + rate_table(rates)
    lines += ["", "### Where W_Q grows", ""]
    if layer is None:
        lines.append("No sn_q columns with data: growth layer not determined.")
    else:
        lines.append("Growth of sn_q = max over logged steps / value at the first logged step, mean over the "
                     "`--fix off` runs of our attention (all runs if there are none): " + ", ".join(
                         f"L{i} {g:.3g}" for i, g in sorted(growth.items())) +
                     f". Largest: **layer {layer}** (per head: spectral_norm_heads.png).")
    return lines + ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]


# -----------------------------------------------------------------------------
# The delta probe (nanolp/diagnostics.py): is delta's error the curvature term tr(H Sigma_e)?

RUNAWAY_LOGIT = 30.0  # layer 0 of every arm stays below this before its runaway: checkpoints are pooled up to it
PROBE_NAMES = dict(total="rowsum(dO * e), what delta reads", lin="rowsum(dO_clean * e), dO not seeing e",
                   curv="the curvature term, tr(H Sigma_e)", indep="an independent rounding of O")


def probe_column(term, se=False):
    return f"probe_{term}{'_se' if se else ''}_L{PROBE_LAYER}"


def runaway_step(run):
    """The first logged step where layer 0's max logit passes RUNAWAY_LOGIT; None if it never does."""
    series = run.series(LOGIT)
    if series is None or not (series[1] > RUNAWAY_LOGIT).any():
        return None
    return float(series[0][series[1] > RUNAWAY_LOGIT][0])


def pooled_probe(run):
    """{term: (mean, se, checkpoints)}, each term's inverse-variance weighted mean over the checkpoints before
    runaway_step (all of them if the logit never gets there), and the standard error of that mean."""
    stop = runaway_step(run)
    pooled = {}
    for term in PROBE_TERMS:
        step, mean, se = (run.log.get(c, np.array([])) for c in ("step", probe_column(term), probe_column(term, True)))
        keep = np.isfinite(mean) & np.isfinite(se) & (se > 0) & (step < stop if stop is not None else True)
        weight = 1 / se[keep] ** 2
        pooled[term] = ((float((weight * mean[keep]).sum() / weight.sum()), float(weight.sum() ** -0.5),
                         int(keep.sum())) if keep.any() else (None, None, 0))
    return pooled


def probe_lines(run):
    pooled, stop = pooled_probe(run), runaway_step(run)
    where = (f"the {pooled['total'][2]} checkpoints before step {stop:,.0f}, where {LOGIT} first passes "
             f"{RUNAWAY_LOGIT:g}" if stop is not None else f"all {pooled['total'][2]} checkpoints ({LOGIT} stays "
             f"below {RUNAWAY_LOGIT:g})")
    lines = [f"`{run.path}` (`{arm(run)}`), pooled over {where}; inverse-variance weighted:",
             "", "| term | what it is | mean | s.e. | mean / s.e. |", "|---|---|---|---|---|"]
    for term, (mean, se, _) in pooled.items():
        lines.append(f"| probe_{term} | {PROBE_NAMES[term]} | {fmt(mean, '+.3e')} | {fmt(se, '.2e')} | "
                     f"{fmt(mean / se if se else None, '+.1f')} |")
    return lines


def plot_probe(runs, path):
    """Per run: the four terms' means with 2 s.e. bands against steps (the curvature term, ~100x smaller, in a
    panel of its own scale below the other three), and layer 0's max logit beside them."""
    fig = plt.figure(figsize=(13, 6.4 * len(runs)))
    grid = fig.add_gridspec(2 * len(runs), 2, width_ratios=(2, 1))
    colours = dict(total="black", lin="tab:blue", curv="tab:red", indep="tab:green")
    for i, run in enumerate(runs):
        terms = fig.add_subplot(grid[2 * i, 0])
        panels = dict(total=terms, lin=terms, indep=terms, curv=fig.add_subplot(grid[2 * i + 1, 0], sharex=terms))
        logit = fig.add_subplot(grid[2 * i:2 * i + 2, 1])
        for term in PROBE_TERMS:
            mean, se = run.series(probe_column(term)), run.series(probe_column(term, True))
            if mean is None or se is None:
                continue
            ax = panels[term]
            ax.plot(*mean, color=colours[term], linewidth=1.2, label=f"probe_{term}: {PROBE_NAMES[term]}")
            ax.fill_between(se[0], mean[1] - 2 * se[1], mean[1] + 2 * se[1], color=colours[term], alpha=0.15,
                            linewidth=0)
        terms.set_title(f"{arm(run)}, seed {run.setting('seed', 0)}: the error delta reads from O's cast in layer "
                        f"{PROBE_LAYER}, mean over the probe's rows (bands: 2 s.e.)", fontsize=10)
        logit.plot(*run.series(LOGIT), color="tab:purple")
        logit.axhline(RUNAWAY_LOGIT, color="k", linestyle=":", linewidth=0.8)
        logit.set_yscale("log")
        logit.set_title(f"layer {PROBE_LAYER}'s max logit (dotted: {RUNAWAY_LOGIT:g})", fontsize=10)
        stop = runaway_step(run)
        for ax in (terms, panels["curv"], logit):
            if ax is not logit:
                ax.axhline(0, color="k", linewidth=0.6)
                ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
                ax.legend(fontsize=8, loc="upper left")
            if stop is not None:
                ax.axvline(stop, color="gray", linestyle="--", linewidth=0.8)
            ax.set_xlabel("step")
            ax.xaxis.set_major_formatter(THOUSANDS)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    return save(fig, path)


def analyze_probe(runs, out):
    runs = [run for run in runs if run.series(probe_column("total")) is not None]
    if not runs:
        raise SystemExit(f"no run with the probe's columns ({probe_column('total')}, ...)")
    lines = ["## Delta probe", "", f"The error the backward's delta would read from O's bf16 cast in layer "
             f"{PROBE_LAYER}, split as the curvature hypothesis splits it (nanolp/diagnostics.py). Predicted: "
             "probe_total = probe_curv > 0, probe_lin = probe_indep = 0. Dashed line in the figure: where the "
             "pooling stops."]
    for run in runs:
        lines += [""] + probe_lines(run)
        print("\n".join(probe_lines(run)))
    figure = plot_probe(runs, out / "delta_probe.png")
    return lines + ["", "### Figures", "", f"![{figure.stem}]({figure.name})"]


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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("runs", nargs="*", help="run folders, or folders of them (default: runs/)")
    parser.add_argument("--out", type=Path, help="where figures and report.md go (default: <runs root>/figures)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--probe", action="store_true", help="the delta probe's columns of the runs")
    mode.add_argument("--mechanism", action="store_true", help="the rounding bias on synthetic rows; no runs")
    args = parser.parse_args(argv)
    if args.mechanism and args.runs:
        parser.error("--mechanism reads no runs")

    paths = [] if args.mechanism else find_runs(args.runs or ["runs"])
    if not args.mechanism and not paths:
        raise SystemExit(f"no run folders (with a log.csv or log.csv.gz) found in {args.runs or ['runs']}")
    root = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path("runs")
    out = args.out or root / "figures"
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(p) for p in paths]

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
