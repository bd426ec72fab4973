"""The rounding bias itself, shown without training: `python analyze.py --mechanism`.

1. The paper's worked example: one fp32 sum rounded to bf16, with the project's own rounding.
2. Controlled inputs (nanolp.tied, as in tests/test_mechanism.py): independent rows, each with its own
   k tied maxima, the other keys 12-18 nats below, mostly negative V. The error of O and of
   delta = rowsum(dO * O) against float64, fix off and on, precision "paper" and "fa2", as a function of
   k: per-row mean error, then its mean and standard error over the rows.
3. A checkpoint of a real run: the mean signed delta error per layer and head (the paper's Fig. 5).

The attention is kernels.flash_attention on a GPU and its PyTorch emulation elsewhere; both have the
same rounding points, so the CPU answer is the kernel's answer.
"""

import json
import math
from dataclasses import fields
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from model import GPT, GPTConfig
from nanolp.data import get_batch, prepare
from nanolp.diagnostics import capture_attention
from nanolp.emulate import emulate_attention, round_bf16
from nanolp.plots import save
from nanolp.tied import INPUTS, grad_out, mean_error, reference, tied_rows

PRECISIONS = ("paper", "fa2")
FIXES = (False, True)
COLORS = {False: "tab:red", True: "tab:blue"}  # fix off / on, as in the run figures
TIES = (1, 2, 3, 4, 8, 16)  # numbers of tied maxima per row (3: the case the fix makes worse in "paper" mode)
ROWS = 65536  # independent tied rows per k (nanolp.tied.tied_rows); ~15 s for all k on 2 CPU cores
PAPER_SUM = -4.70399  # the fp32 sum of P V terms in the paper's worked example, to its printed digits


def attention_backend():
    """The Triton kernel where there is a GPU, else the emulation (same numerics, CPU speed)."""
    if torch.cuda.is_available():
        from kernels import flash_attention
        return flash_attention, "cuda"
    return emulate_attention, "cpu"


def tag(precision, fix):
    return f"{precision}, fix {'on' if fix else 'off'}"


# -----------------------------------------------------------------------------
# 1. One rounding, by hand


def worked_example():
    """Round the paper's fp32 sum to bf16. Its two bf16 neighbours are one ulp apart; the sum lies just
    past their midpoint on the side away from zero, so the error is almost half an ulp, negative."""
    fp32_sum = torch.tensor(PAPER_SUM, dtype=torch.float32)
    rounded = round_bf16(fp32_sum).item()
    ulp = 2.0 ** (math.floor(math.log2(abs(rounded))) - 7)  # bf16 keeps 7 explicit mantissa bits
    midpoint = rounded + math.copysign(ulp / 2, -rounded)
    return dict(fp32=fp32_sum.item(), bf16=rounded, error=rounded - fp32_sum.item(), ulp=ulp,
                midpoint=midpoint)


# -----------------------------------------------------------------------------
# 2. Rows with k tied maxima


@torch.no_grad()
def delta_errors(attend, q, k, v, do, precision, fix, causal):
    """Errors of O and of delta = rowsum(dO * O) against float64. delta is computed as the kernel's
    backward does: from the stored bf16 O and bf16 dO, summed in fp32."""
    o = attend(q, k, v, causal=causal, fix=fix, precision=precision)
    o64 = reference(q, k, v, causal)
    delta = (do.float() * o.float()).sum(-1).double()
    delta64 = (do.double() * o64).sum(-1)
    return o.double() - o64, delta - delta64


def tied_rows_experiment(attend, device, ties=TIES, rows=ROWS, head_dim=64, seed=0):
    """{(precision, fix, k): (O error, delta error)}, each a numpy array of one number per row: the row's mean
    error over its features for O, its error for delta. The inputs are nanolp.tied's (independent rows, each
    with its own k tied maxima); the same seed for every k, as tests/test_mechanism.py does."""
    results = {}
    for k in tqdm(ties, desc=f"tied rows (k), {rows} rows"):
        g = torch.Generator().manual_seed(seed)
        q, keys, v = tied_rows(rows, k, head_dim=head_dim, generator=g)
        do = grad_out(v.shape, generator=g)
        q, keys, v, do = (t.to(device) for t in (q, keys, v, do))
        for precision in PRECISIONS:
            for fix in FIXES:
                err_o, err_delta = delta_errors(attend, q, keys, v, do, precision, fix, causal=False)
                results[precision, fix, k] = (err_o.mean(-1).cpu().numpy().ravel(),
                                              err_delta.cpu().numpy().ravel())
    return results


def stats(per_row):
    """Mean and standard error over rows (nanolp.tied.mean_error)."""
    return mean_error(torch.from_numpy(per_row))


def plot_error_histograms(results, k, path):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, precision in enumerate(PRECISIONS):
        for row, name in enumerate(("O (mean over the row's features)", "delta = rowsum(dO * O)")):
            ax = axes[row, col]
            errors = [results[precision, fix, k][row] for fix in FIXES]
            bins = np.histogram_bin_edges(np.concatenate(errors), bins=60)
            for fix, err in zip(FIXES, errors):
                mean, se = stats(err)
                ax.hist(err, bins=bins, alpha=0.5, color=COLORS[fix],
                        label=f"{tag(precision, fix)}: mean {mean:+.2e} (s.e. {se:.1e})")
                ax.axvline(mean, color=COLORS[fix], linestyle="--")
            ax.axvline(0, color="k", linewidth=0.5)
            ax.set_title(f"per-row error of {name}, precision {precision}", fontsize=10)
            ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 2))
            ax.set_xlabel("low-precision minus float64")
            ax.set_ylabel("rows")
            ax.legend(fontsize=8)
    n = len(results[PRECISIONS[0], FIXES[0], k][0])
    fig.suptitle(f"{n} rows, each with k = {k} tied maxima; {INPUTS}", fontsize=11)
    fig.tight_layout()
    return save(fig, path)


def plot_error_vs_k(results, ties, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, row, name in ((axes[0], 0, "O"), (axes[1], 1, "delta")):
        for precision, linestyle in zip(PRECISIONS, ("-", "--")):
            for fix in FIXES:
                means, ses = zip(*(stats(results[precision, fix, k][row]) for k in ties))
                ax.errorbar(ties, means, yerr=2 * np.array(ses), marker="o", color=COLORS[fix],
                            linestyle=linestyle, capsize=3, label=tag(precision, fix))
        ax.axhline(0, color="k", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ties, [str(k) for k in ties])
        ax.set_xlabel("k, tied maxima per row")
        ax.set_ylabel(f"mean signed error of {name}")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        ax.set_title(f"mean error of {name} against float64 (bars: 2 s.e.)", fontsize=10)
        ax.legend(fontsize=8, handlelength=3)
    n = len(results[PRECISIONS[0], FIXES[0], ties[0]][0])
    fig.suptitle(f"{n} rows with k tied maxima; {INPUTS}", fontsize=11)
    fig.tight_layout()
    return save(fig, path)


# -----------------------------------------------------------------------------
# 3. The same error inside a trained model (the paper's Fig. 5)


def checkpoint_step(path):
    return int(Path(path).stem.split("_")[-1])  # ckpt/step_0001234.pt


def pick_checkpoint(runs):
    """The latest checkpoint before a collapse if any run collapsed, else the latest of any run."""
    best = None
    for run in runs:
        ckpts = sorted(run.path.glob("ckpt/step_*.pt"), key=checkpoint_step)
        if run.collapse_step is not None:
            ckpts = [c for c in ckpts if checkpoint_step(c) < run.collapse_step]
        if ckpts:
            key = (run.collapse_step is not None, checkpoint_step(ckpts[-1]))
            best = max(best, (key, ckpts[-1]), key=lambda b: b[0]) if best else (key, ckpts[-1])
    return best[1] if best else None


def load_model(path, device):
    """GPT from a checkpoint of train.py (its "model" state dict; the settings from its "config", or
    from the run folder's config.json), with fp32 reference attention: q, k, v and dO then come from
    the trained weights, not from the attention under study."""
    ckpt = torch.load(path, map_location=device, weights_only=False)
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}  # torch.compile prefix
    config = dict(ckpt.get("config") or json.loads((path.parent.parent / "config.json").read_text()))
    config["vocab_size"] = state["transformer.wte.weight"].shape[0]
    model_config = GPTConfig(**{f.name: config[f.name] for f in fields(GPTConfig) if f.name in config})
    model_config.attn, model_config.fix = "fp32", False
    model = GPT(model_config).to(device)
    model.load_state_dict(state)
    return model, config


def per_head_delta_error(attend, path, device, batches=2, batch_size=8):
    """{fix: array (n_layer, n_head)} of the mean signed delta error on validation batches."""
    model, config = load_model(path, device)
    data = prepare(config.get("data"))
    precision = config.get("precision", "fa2")
    autocast = torch.autocast(device, dtype=torch.bfloat16)  # the dtypes attention sees in training
    errors = {fix: [] for fix in FIXES}
    for step in tqdm(range(batches), desc="checkpoint batches"):
        # train.py's validation batches: seed 0, step = batch number
        idx, targets = get_batch(data.val.long().to(device), batch_size, model.config.block_size, 0, step)
        for q, k, v, _, do in capture_attention(model, idx, targets, autocast):
            for fix in FIXES:
                _, err = delta_errors(attend, q, k, v, do, precision, fix, causal=True)
                errors[fix].append(err.mean(dim=(0, 2)).cpu().numpy())  # mean over batch and rows
    n_layer = model.config.n_layer
    return {fix: np.mean(np.reshape(e, (batches, n_layer, -1)), axis=0) for fix, e in errors.items()}, precision


def plot_per_head(errors, title, path):
    limit = max(np.abs(e).max() for e in errors.values()) or 1.0
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for ax, fix in zip(axes, FIXES):
        image = ax.imshow(errors[fix], cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
        ax.set_title(f"fix {'on' if fix else 'off'}")
        ax.set_xticks(range(errors[fix].shape[1]))
        ax.set_yticks(range(errors[fix].shape[0]))
        ax.set_xlabel("head")
    axes[0].set_ylabel("layer")
    fig.colorbar(image, ax=axes, label="mean signed delta error (low precision - float64)")
    fig.suptitle(title)
    return save(fig, path)


# -----------------------------------------------------------------------------
# All three, as figures and one section of report.md


def demonstrate(runs, out, checkpoint=None, hist_k=2, **tied):
    attend, device = attention_backend()
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

    results = tied_rows_experiment(attend, device, **tied)
    ties = sorted({key[2] for key in results})
    figures = [plot_error_histograms(results, hist_k, out / "mechanism_error_hist.png"),
               plot_error_vs_k(results, ties, out / "mechanism_error_vs_k.png")]
    combos = [(p, f) for p in PRECISIONS for f in FIXES]
    n = len(results[PRECISIONS[0], FIXES[0], ties[0]][0])
    lines += ["", f"### Rows with k tied maxima ({INPUTS})", "",
              f"{n} independent rows per k (`nanolp.tied.tied_rows`: each row its own one-hot query, its own max "
              "and its own k tied keys; scores exact in bf16), computed with the attention named above. "
              "Per-row mean error against float64, then its mean over the rows (standard error in brackets)."]
    for row, name in ((0, "O"), (1, "delta = rowsum(dO * O)")):
        lines += ["", f"Mean signed error of {name}:", "",
                  "| k | " + " | ".join(tag(p, f) for p, f in combos) + " |",
                  "|---|" + "---|" * len(combos)]
        for k in ties:
            lines.append(f"| {k} | " + " | ".join(
                "{:+.2e} ({:.1e})".format(*stats(results[p, f, k][row])) for p, f in combos) + " |")

    lines += ["", "### Per layer and head, on a checkpoint (the paper's Fig. 5)", ""]
    lines += checkpoint_section(attend, device, checkpoint or pick_checkpoint(runs), out, figures)
    return lines + ["", "### Figures", ""] + [f"![{p.stem}]({p.name})" for p in figures]


def checkpoint_section(attend, device, checkpoint, out, figures):
    """Report lines of part 3 (appending its figure to `figures`), or why it was skipped."""
    if checkpoint is None:
        return [skip("no checkpoint (ckpt/step_*.pt under the runs, or --checkpoint PATH)")]
    try:
        errors, precision = per_head_delta_error(attend, Path(checkpoint), device)
    except FileNotFoundError as e:  # the checkpoint, or the run's text file, is not on this machine
        return [skip(str(e))]
    name = f"{Path(checkpoint).parent.parent.name} step {checkpoint_step(checkpoint)}"
    figures.append(plot_per_head(errors, f"mean signed delta error per layer and head: {name}, "
                                         f"precision {precision}", out / "mechanism_per_head.png"))
    return [f"Checkpoint `{checkpoint}`, precision {precision}. Mean over heads per layer "
            "(fix off / fix on): " + ", ".join(
                f"L{i} {off.mean():+.2e} / {on.mean():+.2e}"
                for i, (off, on) in enumerate(zip(errors[False], errors[True]))) + "."]


def skip(reason):
    print(f"skipping the per-head part: {reason}")
    return f"Skipped: {reason}."
