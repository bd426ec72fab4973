"""The shared look of analyze.py's figures, and the one plotting routine most of them use.

Colour says what kind of attention a run used, the same in every figure: our flash attention
with the fix off is red, with the fix on blue, the fp32 reference green, torch SDPA grey.
Shades within a colour separate variants (e.g. precision "fa2" and "paper"); line style is the seed.
"""

import matplotlib

matplotlib.use("Agg")  # figures go to files; never needs a display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D

PALETTE = {
    "fix off": ["tab:red", "darkred", "lightcoral", "orangered"],
    "fix on": ["tab:blue", "navy", "lightskyblue", "tab:cyan"],
    "fp32": ["tab:green", "darkgreen", "yellowgreen"],
    "sdpa": ["dimgray", "black", "darkgray", "tab:brown"],
}
LINESTYLES = ["-", "--", ":", "-."]
MAX_COLS = 6  # panels per figure row; wider grids wrap


def family(run):
    attn = str(run.setting("attn", "")).lower()
    precision = str(run.setting("precision", "")).lower()
    if "fp32" in attn or "float32" in attn or precision == "fp32":
        return "fp32"
    if any(word in attn for word in ("sdpa", "torch", "math", "cudnn")):
        return "sdpa"
    return "fix on" if str(run.setting("fix", "off")).lower() == "on" else "fix off"


def label(run):
    parts = [str(run.setting("attn", "?"))]
    if family(run) in ("fix off", "fix on"):
        parts += [str(run.setting("precision", "?")), f"fix {run.setting('fix', '?')}"]
    return " ".join(parts + [f"seed {run.setting('seed', '?')}"])


def run_styles(runs):
    """Colour and line style of every run, decided once so that all figures agree."""
    variants = sorted({(family(r), str(r.setting("attn")), str(r.setting("precision"))) for r in runs})
    seeds = sorted({str(r.setting("seed")) for r in runs})
    styles = {}
    for run in runs:
        kind = family(run)
        shade = [v for v in variants if v[0] == kind].index(
            (kind, str(run.setting("attn")), str(run.setting("precision"))))
        styles[run.path] = dict(
            color=PALETTE[kind][shade % len(PALETTE[kind])],
            linestyle=LINESTYLES[seeds.index(str(run.setting("seed"))) % len(LINESTYLES)],
            label=label(run))
    return styles


def auto_log_scale(ax, arrays, decades=2):
    """Log y axis when the plotted values are all positive and span `decades` or more."""
    values = np.concatenate(arrays) if arrays else np.array([])
    values = values[np.isfinite(values)]
    if values.size and values.min() > 0 and values.max() / values.min() >= 10**decades:
        ax.set_yscale("log")


def legend(fig, runs, styles, extra=()):
    handles = [Line2D([], [], **styles[run.path]) for run in runs] + list(extra)
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def save(fig, path):
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_grid(runs, styles, panels, title, ylabel, path, transform=None):
    """One panel per log column (`panels` is a list of rows of column names), every run in each."""
    rows = [row[i:i + MAX_COLS] for row in panels for i in range(0, len(row), MAX_COLS)]
    ncols = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(3.2 * ncols, 2.6 * len(rows) + 0.6),
                             squeeze=False)
    for row, row_axes in zip(rows, axes):
        for column, ax in zip(row, row_axes):
            plotted = []
            for run in runs:
                series = run.series(column)
                if series is None:
                    continue
                steps, values = series
                values = transform(values) if transform else values
                ax.plot(steps, values, **styles[run.path])
                plotted.append(values)
            if not plotted:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            auto_log_scale(ax, plotted)
            ax.set_title(column, fontsize=9)
            ax.grid(alpha=0.3)
        for ax in row_axes[len(row):]:
            ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    legend(fig, runs, styles)
    return save(fig, path)
