"""The shared look of analyze.py's figures, and the one plotting routine most of them use.

Colour says what kind of attention a run used, the same in every figure: our flash attention
with the fix off is red, with the fix on blue, torch SDPA grey. The mechanism controls are green:
fp32 attention in pure greens, delta = rowsum(dP * P) instead of rowsum(dO * O) (delta_from_p, the
paper's control) in olive greens, delta from an fp32 copy of O (delta_fp32) in purples. Shades within a colour
separate variants (precision "fa2" / "paper", the amplifier's mantissa_bits) and arms the config cannot tell
apart; line style is the seed, and also cycles once a family runs out of shades.
A config key missing from an older run reads as 0 / False.
"""

import re

import matplotlib

matplotlib.use("Agg")  # figures go to files; never needs a display
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator

PALETTE = {
    "fix off": ["tab:red", "darkred", "lightcoral", "orangered", "firebrick", "salmon"],
    "fix on": ["tab:blue", "navy", "lightskyblue", "tab:cyan", "royalblue", "steelblue"],
    "fp32": ["tab:green", "darkgreen", "seagreen"],
    "delta from P": ["olivedrab", "yellowgreen", "darkolivegreen"],
    "delta from fp32 O": ["tab:purple", "indigo", "orchid"],
    "sdpa": ["dimgray", "black", "darkgray", "tab:brown"],
}
# one per seed: the seed study has eight (dash patterns as (offset, (on, off, ...)) in points)
LINESTYLES = ["-", "--", ":", "-.", (0, (5, 5)), (0, (1, 1)), (0, (3, 1, 1, 1, 1, 1)), (0, (3, 5, 1, 5, 1, 5))]
MAX_COLS = 3  # panels per figure row; wider grids wrap (6 layers -> 2 rows of 3)


def flag(run, key):
    """A boolean setting; absent (older runs) reads as False."""
    value = run.setting(key, False)
    return value.lower() in ("1", "true", "yes", "on") if isinstance(value, str) else bool(value)


def mantissa_bits(run):
    """The amplifier: P rounded to this many mantissa bits before P V; 0 (or absent) = plain bf16."""
    try:
        return int(run.setting("mantissa_bits", 0) or 0)
    except (TypeError, ValueError):
        return 0


def amplifier(run):
    """"P3b" (P at 3 bits), "VO1b" (V and O at 1 bit; amplify="vo"), or "" without the amplifier."""
    bits = mantissa_bits(run)
    return f"{str(run.setting('amplify', 'p')).upper()}{bits}b" if bits else ""


def family(run):
    attn = str(run.setting("attn", "")).lower()
    precision = str(run.setting("precision", "")).lower()
    if "fp32" in attn or "float32" in attn or precision == "fp32":
        return "fp32"
    if any(word in attn for word in ("sdpa", "torch", "math", "cudnn")):
        return "sdpa"
    if flag(run, "delta_from_p"):
        return "delta from P"
    if flag(run, "delta_fp32"):
        return "delta from fp32 O"
    return "fix on" if str(run.setting("fix", "off")).lower() == "on" else "fix off"


def fix_word(run):
    fix = run.setting("fix", "off")
    return ("on" if fix else "off") if isinstance(fix, bool) else str(fix)


def label(run):
    """"<attn> <precision> fix <off|on>[ P<bits>b or VO<bits>b][ no-pos][ delta-from-p or delta-fp32] seed <s>"
    ("fp32 seed 0" for the fp32 reference, which has no fix and no amplifier)."""
    parts = [str(run.setting("attn", "?"))]
    if family(run) != "fp32":
        parts += [str(run.setting("precision", "?")), f"fix {fix_word(run)}"]
        if amplifier(run):
            parts.append(amplifier(run))
        if run.setting("pos", "learned") == "none":
            parts.append("no-pos")
        if flag(run, "delta_from_p"):
            parts.append("delta-from-p")
        if flag(run, "delta_fp32"):
            parts.append("delta-fp32")
    return " ".join(parts + [f"seed {run.setting('seed', 0)}"])


def variant(run):
    """What separates runs of one family by shade: everything in the label but the seed."""
    return (family(run), str(run.setting("attn")), str(run.setting("precision")), fix_word(run),
            amplifier(run), str(run.setting("pos", "learned")), flag(run, "delta_from_p"), flag(run, "delta_fp32"))


def run_styles(runs):
    """Colour, line style and legend label of every run, decided once so that all figures agree.

    A learning rate other than the most common one among `runs` is added to the label. Runs whose
    labels still coincide (settings the label leaves out: a patched kernel copy, an older amplifier) get
    their folder name appended, and each arm of them (the folder name less its "-s<seed>") its own
    shade; two runs of one arm and seed, the next line style. So no two entries read or look the same."""
    rates = [r.setting("lr") for r in runs]
    usual_lr = max(set(rates), key=rates.count, default=None) if rates else None
    labels = [label(r) + (f" lr {r.setting('lr'):g}" if isinstance(r.setting("lr"), (int, float))
                          and r.setting("lr") != usual_lr else "") for r in runs]
    twinned = {variant(r) for r, text in zip(runs, labels) if labels.count(text) > 1}
    arm = {r.path: variant(r) + ((re.sub(r"-s\d+$", "", r.name),) if variant(r) in twinned else ()) for r in runs}
    arms = sorted(set(arm.values()), key=str)
    seeds = sorted({str(r.setting("seed", 0)) for r in runs})
    styles, seen = {}, []
    for run, text in zip(runs, labels):
        kind = family(run)
        shade = [a for a in arms if a[0] == kind].index(arm[run.path])
        palette = PALETTE[kind]
        twin = (arm[run.path], str(run.setting("seed", 0)))
        # twins (same arm and seed) skip past every seed's dash, so they never borrow another seed's
        dash = seeds.index(str(run.setting("seed", 0))) + len(seeds) * (shade // len(palette) + seen.count(twin))
        seen.append(twin)
        styles[run.path] = dict(
            color=palette[shade % len(palette)],
            linestyle=LINESTYLES[dash % len(LINESTYLES)],
            label=text if labels.count(text) == 1 else f"{text} ({run.name})")
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
