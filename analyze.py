"""Figures and a short report from training runs, and a demonstration of the rounding bias itself.

    python analyze.py                        every run folder under runs/
    python analyze.py runs/a runs/b --out f  just these runs, figures, report.md and rates.csv into f/
    python analyze.py --mechanism            the bias on controlled inputs and on a checkpoint

The story the figures follow (see README.md): with the fix off, delta = rowsum(dO * O)
carries a same-signed error, which grows the spectral norm of W_Q and W_K in one layer, which
raises the attention logits, which makes rows with several tied maxima (the tie rate) common,
which makes the error larger, until the loss explodes. Each figure shows one link of that cycle.
Given runs with the amplifier at several bit counts, it also fits how much later the failure comes per bit
(bits_law.png), the basis of the README's estimate for plain bf16.

analyze.py only reads run folders (nanolp/runs.py); it never imports train.py.
"""

import argparse
import os
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from tqdm import tqdm

from nanolp.plots import (amplifier, auto_log_scale, family, fix_word, flag, legend, mantissa_bits, plot_grid,
                          run_styles, save)
from nanolp.runs import find_runs, load_run
from nanolp.sweep import write_csv

# -----------------------------------------------------------------------------
# Loss: does the run collapse, and when (in steps and in wall-clock minutes)?


def plot_loss(runs, styles, path):
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, x, scale, xlabel in ((axes[0], "step", 1, "step"),
                                 (axes[1], "elapsed_s", 60, "wall-clock time (minutes)")):
        plotted = []
        for run in runs:
            style = dict(styles[run.path], label=None)
            for column, width, alpha in (("train_loss", 0.8, 0.45), ("val_loss", 2.0, 1.0)):
                series = run.series(column, x)
                if series is not None:
                    ax.plot(series[0] / scale, series[1], linewidth=width, alpha=alpha, **style)
                    plotted.append(series[1])
            mark_collapse(ax, run, x, scale, style["color"])
        auto_log_scale(ax, plotted)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("cross-entropy loss (nats/token)")
        ax.grid(alpha=0.3)
    axes[0].set_title("loss against step")
    axes[1].set_title("loss against wall-clock time")
    fig.tight_layout()
    extra = [Line2D([], [], color="k", linewidth=0.8, alpha=0.45, label="train loss"),
             Line2D([], [], color="k", linewidth=2.0, label="val loss")]
    if any(run.collapse_step is not None for run in runs):
        extra.append(Line2D([], [], color="w", marker="X", markeredgecolor="k", markersize=9,
                            label="collapse (summary.json)"))
    legend(fig, runs, styles, extra=extra)
    return save(fig, path)


def mark_collapse(ax, run, x, scale, color):
    """An X on the train-loss curve where summary.json says the run collapsed."""
    where = {"step": run.collapse_step, "elapsed_s": run.summary.get("collapse_minute")}[x]
    train = run.series("train_loss", x)
    if run.collapse_step is None or where is None or train is None:
        return
    loss = np.interp(where, train[0] / scale, train[1])
    ax.plot([where], [loss], marker="X", markersize=11, color=color, markeredgecolor="k", zorder=5)


# -----------------------------------------------------------------------------
# Spectral norms: which layer's W_Q grows first? The paper saw it in layer 2, in a few heads.


def growth_layer(runs):
    """The layer whose sn_q grows most relative to its value at the first logged step.

    Growth of one run's layer = max over logged steps / first logged value, averaged over the
    fix-off runs of our attention (the failing configuration), or over all runs if there are none.
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


# -----------------------------------------------------------------------------
# Early warning: does the tie rate rise before the loss explodes?


def early_warning(run, k):
    """Compare the first step where the tie rate (max over layers) exceeds k times its median over
    the first half of the run with the collapse step.

    "First half" is the logged steps up to half the collapse step, so that a run that keeps going
    after its collapse does not fold the explosion into its own baseline; the search for the
    warning starts after that window. Returns None for runs that did not collapse or log no ties.
    """
    collapse = run.collapse_step
    columns = run.columns(r"tie_rate_L\d+")
    if collapse is None or not columns:
        return None
    rates = np.stack([run.log[c] for c in columns])  # (layers, rows)
    logged = np.isfinite(rates).any(axis=0) & np.isfinite(run.log["step"])
    if not logged.any():
        return None
    steps, tie_rate = run.log["step"][logged], np.nanmax(rates[:, logged], axis=0)
    first_half = steps <= collapse / 2
    if not first_half.any():
        return None
    baseline = float(np.median(tie_rate[first_half]))
    above = steps[~first_half & (tie_rate > k * baseline)]
    warn_step = int(above[0]) if above.size else None
    lead = collapse - warn_step if warn_step is not None and warn_step <= collapse else None
    return dict(collapse_step=collapse, baseline=baseline, warn_step=warn_step, lead=lead)


def warning_sentence(run, warning, k):
    head = (f"- `{run.name}`: the tie rate (max over layers; median {warning['baseline']:.4g} over the "
            f"first half) ")
    if warning["lead"] is not None:
        return head + (f"first exceeded {k:g}x that median at step {warning['warn_step']}, "
                       f"{warning['lead']} steps before the collapse at step {warning['collapse_step']}.")
    if warning["warn_step"] is not None:
        return head + (f"did not rise first: it exceeded {k:g}x that median only at step "
                       f"{warning['warn_step']}, after the collapse at step {warning['collapse_step']}.")
    return head + (f"did not rise first: it never exceeded {k:g}x that median before the run ended "
                   f"(collapse at step {warning['collapse_step']}).")


# -----------------------------------------------------------------------------
# The bits law: how much later does the failure come for each mantissa bit the amplifier leaves P? If steps to the
# failure go as one over the bias, a steady factor per bit extrapolated to 7 bits (P in plain bf16, in "fa2") says
# when plain bf16 would fail, if the same term drove it. Plain-bf16 runs at the same learning rate are the test:
# they are drawn at 7 bits but kept out of the fit.

TAKEOFF_LOGIT = 100.0  # a layer's max logit past this marks the take-off (runs that train normally stay below)
BF16_BITS = 7


def takeoff_step(run):
    """The first logged step where the max logit of the layer that grows most (largest over first value) passes
    TAKEOFF_LOGIT; None if it never does. (Other layers can sit above the line in normal training.)"""
    series = [s for s in (run.series(c) for c in run.columns(r"max_logit_L\d+")) if s is not None]
    if not series:
        return None
    step, logit = max(series, key=lambda s: s[1].max() / s[1][0])
    return int(step[logit > TAKEOFF_LOGIT][0]) if (logit > TAKEOFF_LOGIT).any() else None


def bits_law(runs):
    """For runs of our attention with the fix off and P rounded to B bits: per B, the median take-off and
    collapse steps (and the steps reached by runs without one), and for each measure the factor per bit of a
    least-squares line through log(step) against B, with its value at BF16_BITS. Plain-bf16 runs at the
    amplified runs' learning rate are a row at BF16_BITS with measured=True, not fitted. None with fewer than 2 B."""
    amplified = [r for r in runs if family(r) == "fix off" and amplifier(r).startswith("P")]
    lrs = {r.setting("lr") for r in amplified}
    by_bits = {}
    for run in amplified:
        by_bits.setdefault(mantissa_bits(run), []).append(run)
    plain = [r for r in runs if family(r) == "fix off" and not amplifier(r) and len(lrs) == 1
             and r.setting("lr") in lrs and str(r.setting("precision", "fa2")) == "fa2"]
    if plain:
        by_bits[BF16_BITS] = plain
    rows = [dict(bits=b, runs=len(rs), takeoff=median([takeoff_step(r) for r in rs]),
                 collapse=median([r.collapse_step for r in rs]), reached=max(r.steps or 0 for r in rs),
                 measured=rs is plain) for b, rs in sorted(by_bits.items())]
    fits = {}
    for measure in ("takeoff", "collapse"):
        points = [(r["bits"], r[measure]) for r in rows if r[measure] and not r["measured"]]
        if len({b for b, _ in points}) >= 2:
            slope, intercept = np.polyfit([b for b, _ in points], np.log([s for _, s in points]), 1)
            fits[measure] = dict(per_bit=float(np.exp(slope)), at_bf16=float(np.exp(intercept + slope * BF16_BITS)),
                                 line=(slope, intercept))
    return (rows, fits) if fits else None


def plot_bits_law(rows, fits, path):
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    bits = np.linspace(min(r["bits"] for r in rows), BF16_BITS, 50)
    for measure, color, text in (("takeoff", "tab:orange", f"max logit > {TAKEOFF_LOGIT:g}"),
                                 ("collapse", "tab:red", "loss collapse")):
        points = [(r["bits"], r[measure]) for r in rows if r[measure] and not r["measured"]]
        if points:
            ax.plot(*zip(*points), "o", color=color, label=text)
        measured = [(r["bits"], r[measure]) for r in rows if r[measure] and r["measured"]]
        if measured:
            ax.plot(*zip(*measured), "*", color=color, markersize=13, label=f"{text}, plain bf16 (measured)")
        if measure in fits:
            fit = fits[measure]
            slope, intercept = fit["line"]
            ax.plot(bits, np.exp(intercept + slope * bits), "--", color=color, alpha=0.6,
                    label=f"fit: x{fit['per_bit']:.2f} per bit, {fit['at_bf16']:,.0f} at {BF16_BITS}")
    open_runs = [(r["bits"], r["reached"]) for r in rows if not r["collapse"]]
    if open_runs:
        ax.plot(*zip(*open_runs), "^", color="gray", label="no collapse yet (steps reached)")
    ax.set_yscale("log")
    ax.set_xlabel(f"mantissa bits of P ({BF16_BITS} = plain bf16)")
    ax.set_ylabel("step")
    ax.set_title("time to failure against the amplifier's bits (fix off)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return save(fig, path)


def bits_law_lines(rows, fits):
    lines = ["| P bits | runs | median take-off step | median collapse step | most steps reached |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['bits']}{' (plain bf16)' if r['measured'] else ''} | {r['runs']} | {fmt(r['takeoff'], ',.0f')} "
              f"| {fmt(r['collapse'], ',.0f')} | {r['reached']:,} |" for r in rows]
    names = {"takeoff": f"the take-off (a max logit past {TAKEOFF_LOGIT:g})", "collapse": "the collapse"}
    measured = {m: next((r[m] for r in rows if r["measured"] and r[m]), None) for m in fits}
    lines += [""] + [f"- {names[m]}: x{f['per_bit']:.2f} later per bit; at {BF16_BITS} bits (plain bf16) "
                     f"~{f['at_bf16']:,.0f} steps, an extrapolation"
                     + (f"; measured: {measured[m]:,.0f}" if measured[m] else "") for m, f in fits.items()]
    return lines


# -----------------------------------------------------------------------------
# The report: one table row per run, then what the figures say in numbers.


def fmt(value, spec):
    return "n/a" if value is None else format(value, spec)


def delta_source(run):
    """What the backward's delta read: the forward's O, P (delta_from_p) or an fp32 copy of O (delta_fp32)."""
    return "P" if flag(run, "delta_from_p") else "fp32 O" if flag(run, "delta_fp32") else "O"


def run_table(runs):
    lines = ["| run | fix | backend | precision | amplifier | delta from | seed | collapsed | final val loss "
             "| tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for run in runs:
        if not run.summary:
            collapsed = "n/a (no summary.json)"
        elif run.collapse_step is None:
            collapsed = "no"
        else:
            collapsed = (f"step {run.collapse_step}, "
                         f"{fmt(run.summary.get('collapse_minute'), '.1f')} min")
        known = bool(run.config or run.summary)  # a run in progress may have neither file yet
        cells = [f"`{run.name}`", fix_word(run) if known else None, run.setting("attn"),
                 run.setting("precision"), (amplifier(run) or "-") if known else None,
                 delta_source(run) if known else None,
                 run.setting("seed"), collapsed, fmt(run.final_val_loss, ".4f"),
                 fmt(run.tokens_per_s, ",.0f")]
        lines.append("| " + " | ".join("n/a" if c is None else str(c) for c in cells) + " |")
    return lines


def tie_heads(runs):
    """Per run, the head whose tie rate peaked highest: the paper's failure starts in a few heads, so a layer's
    mean can hide the heads that matter. (Only ties between keys with different values carry the bias; copies of
    one token do not, tests/test_mechanism.py.)"""
    lines = []
    for run in runs:
        peaks = {c: np.nanmax(run.log[c]) for c in run.columns(r"tie_rate_L\d+_H\d+") if np.isfinite(run.log[c]).any()}
        if peaks:
            column = max(peaks, key=peaks.get)
            layer, head = column[len("tie_rate_L"):].split("_H")
            lines.append(f"- `{run.name}`: layer {layer}, head {head}: {peaks[column]:.3g} of its rows tied")
    return lines or ["No per-head tie rates in these logs (they start with session 4's runs)."]


def median(values):
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def arm_rates(runs):
    """One row per arm of a seed study (Run.arm), in the order the arms first appear: how many of its runs
    collapsed, the median minutes to collapse over those, and medians over all of its runs."""
    arms = {}
    for run in runs:
        arms.setdefault(run.arm, []).append(run)
    rows = []
    for arm, group in arms.items():
        collapsed = [run for run in group if run.collapse_step is not None]
        rows.append(dict(arm=arm, collapsed=len(collapsed), runs=len(group),
                         median_collapse_minute=median([run.summary.get("collapse_minute") for run in collapsed]),
                         **{f"median_{key}": median([getattr(run, key) for run in group])
                            for key in ("steps", "final_val_loss", "max_logit", "tokens_per_s")}))
    reference = next((group for group in arms.values() if all(family(run) == "fp32" for run in group)), None)
    for row, group in zip(rows, arms.values()):
        row["val_step"], row["val_loss_vs_fp32"] = val_loss_vs(group, reference) if reference else (None, None)
    return rows


def val_loss_vs(group, reference):
    """Issue 7's yardstick: the median val loss of `group` over the reference arm's (fp32 attention), both at the
    last step where every run of either logged one; (step, ratio), or (None, None) without such a step."""
    curves = [(run, run.series("val_loss")) for run in group + reference]
    if any(curve is None for _, curve in curves):
        return None, None
    common = set.intersection(*(set(curve[0].tolist()) for _, curve in curves))
    if not common:
        return None, None
    step = max(common)  # a run's final evaluation falls between the others' regular ones
    at_step = {run.path: curve[1][curve[0] == step] for run, curve in curves}
    ratio = median([float(at_step[r.path][0]) for r in group]) / median([float(at_step[r.path][0]) for r in reference])
    return int(step), ratio


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


def analyze_runs(runs, out, warn_k):
    """All run figures into `out`; returns the report section as a list of markdown lines."""
    styles = run_styles(runs)
    n_layer = layer_count(runs)
    layers = range(n_layer)
    figures = [plot_loss(runs, styles, out / "loss.png")]
    if n_layer:
        figures.append(plot_grid(
            runs, styles, [[f"max_logit_L{i}" for i in layers]], "max attention logit per layer",
            "max scaled logit q.k/sqrt(d)", out / "max_logit.png"))
        figures.append(plot_grid(
            runs, styles, [[f"sn_q_L{i}" for i in layers], [f"sn_k_L{i}" for i in layers]],
            "spectral norm of W_Q (top) and W_K (bottom) per layer", "spectral norm",
            out / "spectral_norm.png"))
    layer, growth = growth_layer(runs)
    if layer is not None and head_count(runs, layer):
        figures.append(plot_grid(
            runs, styles, [[f"sn_q_L{layer}_H{h}" for h in range(head_count(runs, layer))]],
            f"spectral norm of W_Q per head in layer {layer}, where sn_q grows most",
            "spectral norm", out / "spectral_norm_heads.png"))
    if n_layer:
        sharp = [[f"sharp_rate_L{i}" for i in layers]] if any(run.columns(r"sharp_rate_L\d+") for run in runs) else []
        figures.append(plot_grid(
            runs, styles, [[f"tie_rate_L{i}" for i in layers]] + sharp,
            "tie rate: rows with >= 2 scores within TIE_TOL of the row max"
            + ("; below, sharp rate: rows whose largest P exceeds 1 - 1e-3" if sharp else ""),
            "fraction of rows", out / "tie_rate.png"))
        figures.append(plot_grid(
            runs, styles, [[f"delta_err_L{i}" for i in layers], [f"delta_push_L{i}" for i in layers]],
            "cumulative signed delta error (top) and its push on |W_Q|^2 + |W_K|^2 (bottom), summed over logged steps",
            "cumulative sum", out / "delta_err.png", transform=np.cumsum))

    rates = arm_rates(runs)
    write_csv(out / "rates.csv", rates, list(rates[0]))
    lines = ["## Runs", ""] + run_table(runs) + ["", "### Collapse rate per arm", ""]
    lines += ["Arms as nanolp/sweep.py names them (the run name less its `-s<seed>`); medians over each arm's "
              "runs, minutes to collapse over its collapsed runs only. Also in rates.csv.", ""]
    lines += rate_table(rates) + ["", "### Where W_Q grows", ""]
    if layer is None:
        lines.append("No sn_q columns with data: growth layer not determined.")
    else:
        lines.append(f"Growth of sn_q = max over logged steps / value at the first logged step, mean "
                     f"over the runs of our attention with the fix off: " + ", ".join(
                         f"L{i} {g:.3g}" for i, g in sorted(growth.items())) +
                     f". Largest: **layer {layer}** (per-head plot: spectral_norm_heads.png).")
    lines += ["", "### Heads with the most ties (peak over logged steps)", ""] + tie_heads(runs)
    lines += ["", f"### Early warning (threshold k = {warn_k:g})", ""]
    warnings = [(run, early_warning(run, warn_k)) for run in runs]
    warnings = [warning_sentence(run, w, warn_k) for run, w in warnings if w is not None]
    lines += warnings or ["No collapsed run with tie-rate data."]
    law = bits_law(runs)
    if law:
        figures.append(plot_bits_law(*law, out / "bits_law.png"))
        lines += ["", "### The bits law (fix off, P rounded to fewer bits)", ""] + bits_law_lines(*law)
    lines += ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]
    return lines


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
    parser.add_argument("--out", type=Path, help="where figures and report.md go "
                                                 "(default: <runs root>/figures)")
    parser.add_argument("--warn-k", type=float, default=2.0, help="early-warning threshold factor")
    parser.add_argument("--mechanism", action="store_true", help="demonstrate the rounding bias")
    parser.add_argument("--checkpoint", type=Path, help="checkpoint for the per-head delta error "
                                                        "(default: latest under the runs)")
    args = parser.parse_args(argv)

    paths = find_runs(args.runs or ["runs"])
    root = Path(os.path.commonpath([p.parent for p in paths])) if paths else Path(
        (args.runs or ["runs"])[0])
    out = args.out or root / "figures"
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(p) for p in tqdm(paths, desc="reading runs", disable=len(paths) < 8)]

    if args.mechanism:
        from nanolp.mechanism import demonstrate  # torch, model.py and the attention: only needed here
        section = demonstrate(runs, out, args.checkpoint)
    elif runs:
        section = analyze_runs(runs, out, args.warn_k)
    else:
        raise SystemExit(f"no run folders (with a log.csv) found in {args.runs or ['runs']}")
    update_report(out / "report.md", section)
    print(f"wrote {out / 'report.md'} and figures in {out}")


if __name__ == "__main__":
    main()
