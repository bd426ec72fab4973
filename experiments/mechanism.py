"""The rounding bias itself, shown without training: `python analyze.py --mechanism`.

1. The paper's worked example: one fp32 sum rounded to bf16, with the project's own rounding.
2. The paper's bias, on rows with k tied maxima (experiments.tied, as in tests/test_mechanism.py): independent rows,
   each with its own k tied maxima, the other keys 12-18 nats below, mostly negative V. The error of O and of
   delta = rowsum(dO * O) against float64 for `--fix off`, `--fix paper` (the shifted row max) and `--fix on` (fix
   off's O, delta from the forward's fp32 O), precision "autocast" and "fa2", as a function of k: per-row mean
   error, then its mean and standard error over the rows.
3. The curvature effect (experiments.curvature), on a quadratic loss with known curvature H: the mean error delta
   reads from a rounded O against the predicted tr(H Sigma_e), for round-to-nearest, stochastic rounding and an
   independent rounding (delta reading a draw the forward never saw).

The attention is kernels.flash_attention on a GPU and its PyTorch emulation elsewhere; both have the
same rounding points, so the CPU answer is the kernel's answer.
"""

import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from experiments.curvature import ROUNDINGS, synthetic_delta_error
from experiments.tied import INPUTS, grad_out, mean_error, reference, tied_rows
from kernels import Numerics
from nanolp.emulate import emulate_attention, emulate_forward_fp32
from nanolp.plots import PALETTE, save

PRECISIONS = ("autocast", "fa2")
FIXES = ("off", "paper", "on")  # kernels.FIXES (train.py's --fix), in the order the tables and figures show them
O_FIXES = ("off", "paper")  # --fix on's forward is --fix off's: the same O, only delta reads another
COLORS = {fix: PALETTE[f"fix {fix}"][0] for fix in FIXES}  # as in the run figures
TIES = (1, 2, 3, 4, 8, 16)  # numbers of tied maxima per row (3: the case the shift makes worse in "autocast" mode)
ROWS = 65536  # independent tied rows per k (experiments.tied.tied_rows); all k in under a minute on 2 CPU cores
PAPER_SUM = -4.70399  # the fp32 sum of P V terms in the paper's worked example, to its printed digits
CURVATURES = (0.25, 1.0, 4.0)  # scales of H's eigenvalues
CURVATURE_ROWS = 50_000  # rows per point: the 9 points take ~15 s on 2 CPU cores
GRADIENT = 1e-3  # how far (rms, per element) the rows sit from the loss's minimum: tiny, as after memorisation
ROUNDING_COLORS = dict(nearest="tab:red", stochastic="tab:orange", independent="tab:green")


def attention_backend():
    """(attention, its fp32 forward with --fix on, device): the Triton kernel where there is a GPU (the fp32 O:
    the O delta reads, kernels.forward's o_delta), else the emulation (same numerics, CPU speed)."""
    if torch.cuda.is_available():
        from kernels import flash_attention, forward
        return flash_attention, lambda q, k, v, **options: forward(q, k, v, **options).o_delta, "cuda"
    return emulate_attention, emulate_forward_fp32, "cpu"


def tag(precision, fix):
    return f"--fix {fix} --precision {precision}"


# -----------------------------------------------------------------------------
# 1. One rounding, by hand


def worked_example():
    """Round the paper's fp32 sum to bf16. Its two bf16 neighbours are one ulp apart; the sum lies just
    past their midpoint on the side away from zero, so the error is almost half an ulp, negative."""
    fp32_sum = torch.tensor(PAPER_SUM, dtype=torch.float32)
    rounded = fp32_sum.to(torch.bfloat16).item()   # ROUND: to the nearest bf16, ties to even
    ulp = 2.0 ** (math.floor(math.log2(abs(rounded))) - 7)  # bf16 keeps 7 explicit mantissa bits
    midpoint = rounded + math.copysign(ulp / 2, -rounded)
    return dict(fp32=fp32_sum.item(), bf16=rounded, error=rounded - fp32_sum.item(), ulp=ulp,
                midpoint=midpoint)


# -----------------------------------------------------------------------------
# 2. Rows with k tied maxima


@torch.no_grad()
def delta_errors(attend, forward_fp32, q, k, v, do, precision, fix):
    """Errors of O and of delta = rowsum(dO * O) against float64. delta is computed as the kernel's backward does,
    summed in fp32 from bf16 dO and the O it reads: the stored bf16 O, or with --fix on the forward's fp32 O."""
    numerics = Numerics(precision=precision)
    o = attend(q, k, v, causal=False, fix=fix, numerics=numerics)
    read = forward_fp32(q, k, v, causal=False, fix=fix, numerics=numerics) if fix == "on" else o
    o64 = reference(q, k, v)
    delta = (do.float() * read.float()).sum(-1).double()
    delta64 = (do.double() * o64).sum(-1)
    return o.double() - o64, delta - delta64


def tied_rows_experiment(attend, forward_fp32, device, ties=TIES, rows=ROWS, head_dim=64, seed=0):
    """{(precision, fix, k): (O error, delta error)}, each a numpy array of one number per row: the row's mean
    error over its features for O, its error for delta. The inputs are experiments.tied's (independent rows, each
    with its own k tied maxima); the same seed for every k, as tests/test_mechanism.py does."""
    results = {}
    for k in tqdm(ties, desc=f"tied rows (k), {rows} rows"):
        g = torch.Generator().manual_seed(seed)
        q, keys, v = tied_rows(rows, k, head_dim=head_dim, generator=g)
        do = grad_out(v.shape, generator=g)
        q, keys, v, do = (t.to(device) for t in (q, keys, v, do))
        for precision in PRECISIONS:
            for fix in FIXES:
                err_o, err_delta = delta_errors(attend, forward_fp32, q, keys, v, do, precision, fix)
                results[precision, fix, k] = (err_o.mean(-1).cpu().numpy().ravel(),
                                              err_delta.cpu().numpy().ravel())
    return results


def stats(per_row):
    """Mean and standard error over rows (experiments.tied.mean_error)."""
    return mean_error(torch.from_numpy(per_row))


ERRORS = ((0, "O", O_FIXES), (1, "delta = rowsum(dO * O)", FIXES))  # (index in a result, name, fixes)


def plot_error_histograms(results, k, path):
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5))
    for col, precision in enumerate(PRECISIONS):
        for row, name, fixes in ERRORS:
            ax = axes[row, col]
            errors = [results[precision, fix, k][row] for fix in fixes]
            bins = np.histogram_bin_edges(np.concatenate(errors), bins=60)
            for fix, err in zip(fixes, errors):
                mean, se = stats(err)
                ax.hist(err, bins=bins, alpha=0.45, color=COLORS[fix],
                        label=f"{tag(precision, fix)}: mean {mean:+.2e} (s.e. {se:.1e})")
                ax.axvline(mean, color=COLORS[fix], linestyle="--")
            ax.axvline(0, color="k", linewidth=0.5)
            ax.set_title(f"per-row error of {name}, precision {precision}", fontsize=10)
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
            ax.set_xlabel("low-precision minus float64")
            ax.set_ylabel("rows")
            ax.legend(fontsize=8)
    n = len(results[PRECISIONS[0], "off", k][0])
    fig.suptitle(f"{n} rows, each with k = {k} tied maxima; {INPUTS}\n(O: --fix on's O is --fix off's)",
                 fontsize=11)
    fig.tight_layout()
    return save(fig, path)


def plot_error_vs_k(results, ties, path):
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (row, name, fixes) in zip(axes, ERRORS):
        for precision, linestyle in zip(PRECISIONS, ("-", "--")):
            for fix in fixes:
                means, ses = zip(*(stats(results[precision, fix, k][row]) for k in ties))
                ax.errorbar(ties, means, yerr=2 * np.array(ses), marker="o", color=COLORS[fix],
                            linestyle=linestyle, capsize=3, label=tag(precision, fix))
        ax.axhline(0, color="k", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ties, [str(k) for k in ties])
        ax.set_xlabel("k, tied maxima per row")
        ax.set_ylabel(f"mean signed error of {name.split(' =')[0]}")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title(f"mean error of {name} against float64 (bars: 2 s.e.)", fontsize=10)
        ax.legend(fontsize=8, handlelength=3)
    n = len(results[PRECISIONS[0], "off", ties[0]][0])
    fig.suptitle(f"{n} rows with k tied maxima; {INPUTS} (O: --fix on's O is --fix off's)", fontsize=11)
    fig.tight_layout()
    return save(fig, path)


def tied_rows_lines(results):
    ties = sorted({key[2] for key in results})
    n = len(results[PRECISIONS[0], "off", ties[0]][0])
    lines = [f"{n} independent rows per k (`experiments.tied.tied_rows`: each row its own one-hot query, its own max "
             "and its own k tied keys; scores exact in bf16), computed with the attention named above. "
             "Per-row mean error against float64, then its mean over the rows (standard error in brackets). "
             "`--fix on`'s O is `--fix off`'s; its delta reads the forward's fp32 O."]
    for row, name, fixes in ERRORS:
        combos = [(p, f) for p in PRECISIONS for f in fixes]
        lines += ["", f"Mean signed error of {name}:", "",
                  "| k | " + " | ".join(f"`{tag(p, f)}`" for p, f in combos) + " |",
                  "|---|" + "---|" * len(combos)]
        lines += [f"| {k} | " + " | ".join("{:+.2e} ({:.1e})".format(*stats(results[p, f, k][row]))
                                          for p, f in combos) + " |" for k in ties]
    return lines


# -----------------------------------------------------------------------------
# 3. The curvature effect: one-signed although the rounding is not


def curvature_experiment(curvatures=CURVATURES, rows=CURVATURE_ROWS, gradient=GRADIENT):
    """{(rounding, curvature): experiments.curvature.synthetic_delta_error's dict(mean, se, predicted)}, each point
    from rows of its own (seed), so that the points are independent measurements."""
    points = [(rounding, c) for rounding in ROUNDINGS for c in curvatures]
    return {(rounding, c): synthetic_delta_error(rounding, rows=rows, curvature=c, gradient=gradient, seed=seed)
            for seed, (rounding, c) in enumerate(tqdm(points, desc=f"curvature, {rows} rows"))}


def plot_curvature(results, path):
    fig, ax = plt.subplots(figsize=(6.8, 5.6))
    top = 1.15 * max(r["predicted"] + 2 * r["se"] for r in results.values())
    ax.plot([0, top], [0, top], color="k", linewidth=0.8, linestyle=":", label="measured = predicted")
    for rounding in ROUNDINGS:
        points = [(c, r) for (name, c), r in results.items() if name == rounding]
        ax.errorbar([r["predicted"] for _, r in points], [r["mean"] for _, r in points],
                    yerr=[2 * r["se"] for _, r in points], marker="o", linestyle="none", capsize=3,
                    color=ROUNDING_COLORS[rounding],
                    label=rounding + (" (predicted 0)" if rounding == "independent" else ""))
        if rounding != "independent":  # its points all sit at predicted 0
            for c, r in points:
                ax.annotate(f"H x{c:g}", (r["predicted"], r["mean"]), textcoords="offset points", xytext=(6, -10),
                            fontsize=8, color=ROUNDING_COLORS[rounding])
    ax.set_xlim(-0.03 * top, top)
    ax.set_ylim(-0.03 * top, top)
    ax.ticklabel_format(style="sci", scilimits=(-2, 2))
    ax.set_xlabel("predicted mean, tr(H Sigma_e)")
    ax.set_ylabel("measured mean of rowsum(dO * e) (bars: 2 s.e.)")
    widest = max(2 * r["se"] for r in results.values())
    ax.set_title("the error delta reads from a rounded O, on a quadratic loss\n"
                 f"(rows {GRADIENT:g} from the minimum; 2 s.e. bars, at most {widest:.0e})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="upper left")
    fig.tight_layout()
    return save(fig, path)


def curvature_lines(results, rows, gradient):
    lines = [f"Rows of 64 features of a quadratic loss L(O) = g.O + 1/2 O^T H O (`experiments.curvature`), {rows:,} "
             f"rows per point, {gradient:g} (rms) from the loss's minimum; H's eigenvalues uniform in [0.5, 1.5] "
             "times the scale. e = the rounding error delta reads; dO is the loss's gradient at the forward's "
             "rounded O (\"independent\": the forward rounds to nearest, delta reads an independent stochastic "
             "rounding).", "",
             "| rounding | H scale | predicted tr(H Sigma_e) | measured mean | s.e. | measured / predicted |",
             "|---|---|---|---|---|---|"]
    for (rounding, c), r in results.items():
        ratio = f"{r['mean'] / r['predicted']:.3f}" if r["predicted"] else "-"
        lines.append(f"| {rounding} | {c:g} | {r['predicted']:.3e} | {r['mean']:+.3e} | {r['se']:.1e} | {ratio} |")
    return lines


# -----------------------------------------------------------------------------
# All three, as figures and one section of report.md


def demonstrate(out, hist_k=2, curvature_rows=CURVATURE_ROWS, **tied):
    attend, forward_fp32, device = attention_backend()
    emulated = (" (the kernel's PyTorch emulation: same rounding points, so the kernel's numbers)"
                if device == "cpu" else "")
    lines = ["## Mechanism", "", f"Attention: {attend.__module__}.{attend.__name__} on {device}{emulated}.", "",
             "### One rounding (the paper's worked example)", ""]
    ex = worked_example()
    print(f"fp32 sum {ex['fp32']:.7f} -> bf16 {ex['bf16']:.5f}, error {ex['error']:+.5f}")
    lines.append(f"The fp32 sum {ex['fp32']:.7f} rounds to **{ex['bf16']:.5f}** in bf16 (error "
                 f"{ex['error']:+.5f}). Its bf16 neighbours are {ex['ulp']:g} apart; the sum lies "
                 f"{abs(ex['fp32'] - ex['midpoint']):.5f} past their midpoint {ex['midpoint']:.6f}, "
                 f"on the side away from zero, so it rounds away from zero by almost half a step.")

    results = tied_rows_experiment(attend, forward_fp32, device, **tied)
    ties = sorted({key[2] for key in results})
    figures = [plot_error_histograms(results, hist_k, out / "mechanism_error_hist.png"),
               plot_error_vs_k(results, ties, out / "mechanism_error_vs_k.png")]
    lines += ["", f"### Rows with k tied maxima ({INPUTS})", ""] + tied_rows_lines(results)

    curvature = curvature_experiment(rows=curvature_rows)
    figures.append(plot_curvature(curvature, out / "curvature.png"))
    table = curvature_lines(curvature, curvature_rows, GRADIENT)
    print("\n".join(table))
    lines += ["", "### The curvature effect: one-signed although the rounding is unbiased", ""] + table
    return lines + ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]
