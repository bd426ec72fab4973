"""The shared look of analyze.py's figures, and the one plotting routine most of them use.

A run is named by its arm, the train.py flags that set it apart from its preset (analyze.arm), and its seed.
Colour says what kind of attention the arm used, the same in every figure: our flash attention with `--fix off`
red, `--fix on` blue, `--fix paper` orange, torch SDPA grey, fp32 attention green, `--delta p` (the paper's control)
olive, `--delta fp32-o` purple. Shades within a colour separate the arms of one kind; line style is the seed (the
headline gives each arm a hue of its own instead, arm_hues). A
config key missing from an older run reads as train.py's default.
"""

import itertools

import matplotlib

matplotlib.use("Agg")  # figures go to files; never needs a display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter, MaxNLocator

PALETTE = {
    "fix off": ["tab:red", "darkred", "lightcoral", "orangered", "firebrick", "salmon"],
    "fix on": ["tab:blue", "navy", "lightskyblue", "tab:cyan", "royalblue", "steelblue"],
    "fix paper": ["tab:orange", "darkgoldenrod", "sandybrown", "chocolate"],
    "fp32": ["tab:green", "darkgreen", "seagreen"],
    "delta from P": ["olivedrab", "yellowgreen", "darkolivegreen"],
    "delta from fp32 O": ["tab:purple", "indigo", "orchid"],
    "sdpa": ["dimgray", "black", "darkgray", "tab:brown"],
}
# the headline's hues, one per arm: its family's own colour first, then these where two arms share a family
HUES = ["tab:red", "tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:gray",
        "tab:olive", "tab:cyan", "black"]
# one per seed: the seed study has eight (dash patterns as (offset, (on, off, ...)) in points)
LINESTYLES = ["-", "--", ":", "-.", (0, (5, 5)), (0, (1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (3, 5, 1, 5, 1, 5))]
MAX_COLS = 3  # panels per figure row; wider grids wrap (6 layers -> 2 rows of 3)


def step_axis(axis):
    """Step labels of an x axis: 150k, not 150000, where the axis reaches 10,000 steps; 1,000 below (not 0.05k)."""
    def label(step, _):
        long = max(abs(limit) for limit in axis.get_view_interval()) >= 10_000
        return f"{step / 1000:g}k" if long and step else f"{step:,g}"
    axis.set_major_formatter(FuncFormatter(label))   # one formatter per axis: it reads that axis's range


def fix_word(run):
    """--fix as train.py spells it: off, on or paper."""
    return str(run.setting("fix", "off"))


def family(run):
    """The colour a run is drawn in (a key of PALETTE)."""
    attn = str(run.setting("attn", "kernel"))
    if attn == "fp32":
        return "fp32"
    if attn.startswith("sdpa"):
        return "sdpa"
    if run.setting("delta") == "p":
        return "delta from P"
    if run.setting("delta") == "fp32-o":
        return "delta from fp32 O"
    return f"fix {fix_word(run)}"


def arm_hues(families):
    """{arm: colour} of {arm: its family (a key of PALETTE)}: one clearly different hue per arm, no two shades of
    one: the family's own colour for its first arm, then the unused of HUES, in order, for the others (round again
    where there are more arms than hues: two arms share a hue, rather than no figure)."""
    own = {}
    for arm, kind in families.items():
        own.setdefault(PALETTE[kind][0], arm)
    spare = itertools.cycle([h for h in HUES if h not in own])
    mine = {arm: colour for colour, arm in own.items()}
    return {arm: mine.get(arm) or next(spare) for arm in families}


def run_styles(runs, arms):
    """Colour, line style and legend label ("<arm>, seed <s>") of every run, decided once so that all figures
    agree. arms: {run.path: the run's arm}. Each arm gets its own shade of its family's colour, each seed its own
    line style; the same arm and seed twice (two folders) gets the folder names in the labels and the next line
    style, so that no two entries read the same, nor look it while the styles needed fit LINESTYLES (past them, as
    with eight seeds and a twin, a style comes round again)."""
    seed = {run.path: str(run.setting("seed", 0)) for run in runs}
    seeds = sorted(set(seed.values()))
    labels = [f"{arms[run.path]}, seed {seed[run.path]}" for run in runs]
    styles, seen = {}, []
    for run, text in zip(runs, labels):
        kind = family(run)
        shade = sorted({arms[r.path] for r in runs if family(r) == kind}).index(arms[run.path])
        palette = PALETTE[kind]
        twin = (arms[run.path], seed[run.path])
        # twins skip past every seed's dash, so they never borrow another seed's
        dash = seeds.index(seed[run.path]) + len(seeds) * (shade // len(palette) + seen.count(twin))
        seen.append(twin)
        styles[run.path] = dict(
            color=palette[shade % len(palette)], linestyle=LINESTYLES[dash % len(LINESTYLES)],
            label=text if labels.count(text) == 1 else f"{text} ({run.path.parent.name}/{run.path.name})")
    return styles


def auto_log_scale(ax, arrays, decades=2):
    """Log y axis when the plotted values are all positive and span `decades` or more."""
    values = np.concatenate(arrays) if arrays else np.array([])
    values = values[np.isfinite(values)]
    if values.size and values.min() > 0 and values.max() / values.min() >= 10**decades:
        ax.set_yscale("log")


def legend(fig, handles):
    fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)


def save(fig, path):
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_grid(runs, styles, panels, title, ylabel, path, transform=None):
    """One panel per log column (`panels` is a list of rows of column names), every run in each."""
    rows = [row[i:i + MAX_COLS] for row in panels for i in range(0, len(row), MAX_COLS)]
    ncols = max(len(row) for row in rows)
    fig, axes = plt.subplots(len(rows), ncols, figsize=(4.0 * ncols, 2.9 * len(rows) + 0.6),
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
            ax.xaxis.set_major_locator(MaxNLocator(nbins=4))  # six-digit step labels overlap in a narrow panel
            step_axis(ax.xaxis)
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
    legend(fig, [Line2D([], [], **styles[run.path]) for run in runs])
    return save(fig, path)
