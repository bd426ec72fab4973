"""The rounding bias itself, shown without training: `python analyze.py --mechanism`.

1. The paper's worked example: one fp32 sum rounded to bf16, with the project's own rounding.
2. Controlled inputs: rows with k tied maxima and mostly negative V. The error of O and of
   delta = rowsum(dO * O) against float64, fix off and on, precision "paper" and "fa2", and how the
   mean error grows with k.
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
from nanolp.emulate import TILE_N, emulate_attention, round_bf16
from nanolp.plots import save

PRECISIONS = ("paper", "fa2")
FIXES = (False, True)
COLORS = {False: "tab:red", True: "tab:blue"}  # fix off / on, as in the run figures
TIES = (1, 2, 4, 8, 16)  # numbers of tied maxima per row
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


def tied_inputs(k, batch=8, heads=8, n=128, dim=64, score=12.0, seed=0, device="cpu"):
    """q, k, v, dO (batch, heads, n, dim) in bf16 where every query row has exactly k tied maximal scores.

    Every query is a * u plus noise for one unit vector u; keys 0..k-1 are the identical vector a * u,
    so their scores are bit-identical, about `score` nats, far above the other keys' scores (about 5
    at most): the tied keys hold the row max and all other P entries are tiny. Adjacent tied keys share
    a key tile, where the per-tile fix can see them. V ~ N(-0.5, 1) makes most values negative, like the
    paper's failing feature; dO ~ N(0.5, 1) is a gradient that, like a real one, has a preferred sign.
    All rows of a head share the tied keys' V, so it takes many (batch, head) pairs to average over V.
    """
    assert k <= TILE_N, "the tied keys must share one key tile for the per-tile fix to see them"
    gen = torch.Generator().manual_seed(seed)
    a = math.sqrt(score * math.sqrt(dim))  # (a u).(a u) / sqrt(dim) = score
    u = torch.randn(dim, generator=gen)
    hot = a * u / u.norm()
    shape = (batch, heads, n, dim)
    q = hot + torch.randn(shape, generator=gen)
    keys = torch.randn(shape, generator=gen)
    keys[:, :, :k] = hot
    v = torch.randn(shape, generator=gen) - 0.5
    do = torch.randn(shape, generator=gen) + 0.5
    return [t.to(device, torch.bfloat16) for t in (q, keys, v, do)]


def reference(q, k, v, causal):
    """Softmax attention in float64 from the same (rounded) inputs: the exact answer to compare with."""
    q, k, v = (t.double() for t in (q, k, v))
    S = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n = S.shape[-1]
        S = S.masked_fill(torch.ones(n, n, dtype=torch.bool, device=S.device).triu(1), -math.inf)
    return S.softmax(-1) @ v


@torch.no_grad()
def delta_errors(attend, q, k, v, do, precision, fix, causal):
    """Errors of O and of delta = rowsum(dO * O) against float64. delta is computed as the kernel's
    backward does: from the stored bf16 O and bf16 dO, summed in fp32."""
    o = attend(q, k, v, causal=causal, fix=fix, precision=precision)
    o64 = reference(q, k, v, causal)
    delta = (do.float() * o.float()).sum(-1).double()
    delta64 = (do.double() * o64).sum(-1)
    return o.double() - o64, delta - delta64


def tied_rows_experiment(attend, device, ties=TIES, **shape):
    """{(precision, fix, k): (O errors, delta errors)} as flat numpy arrays."""
    results = {}
    for k in tqdm(ties, desc="tied rows (k)"):
        q, keys, v, do = tied_inputs(k, device=device, **shape)
        for precision in PRECISIONS:
            for fix in FIXES:
                err_o, err_delta = delta_errors(attend, q, keys, v, do, precision, fix, causal=False)
                results[precision, fix, k] = (err_o.cpu().numpy().ravel(), err_delta.cpu().numpy().ravel())
    return results


def plot_error_histograms(results, k, path):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for col, precision in enumerate(PRECISIONS):
        for row, name in enumerate(("O", "delta = rowsum(dO * O)")):
            ax = axes[row, col]
            errors = [results[precision, fix, k][row] for fix in FIXES]
            bins = np.histogram_bin_edges(np.concatenate(errors), bins=60)
            for fix, err in zip(FIXES, errors):
                ax.hist(err, bins=bins, alpha=0.5, color=COLORS[fix],
                        label=f"{tag(precision, fix)}: mean {err.mean():+.2e}")
                ax.axvline(err.mean(), color=COLORS[fix], linestyle="--")
            ax.set_title(f"error of {name}, precision {precision}", fontsize=10)
            ax.set_xlabel("low-precision minus float64")
            ax.set_ylabel("count")
            ax.legend(fontsize=8)
    fig.suptitle(f"rows with k = {k} tied maxima, V ~ N(-0.5, 1), dO ~ N(0.5, 1)")
    fig.tight_layout()
    return save(fig, path)


def plot_error_vs_k(results, ties, path):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, row, name in ((axes[0], 0, "O"), (axes[1], 1, "delta")):
        for precision, linestyle in zip(PRECISIONS, ("-", "--")):
            for fix in FIXES:
                means = [results[precision, fix, k][row].mean() for k in ties]
                ax.plot(ties, means, marker="o", color=COLORS[fix], linestyle=linestyle,
                        label=tag(precision, fix))
        ax.axhline(0, color="k", linewidth=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k, tied maxima per row")
        ax.set_ylabel(f"mean signed error of {name}")
        ax.set_title(f"mean error of {name} against float64")
        ax.legend(fontsize=8)
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


def demonstrate(runs, out, checkpoint=None, hist_k=2, **shape):
    attend, device = attention_backend()
    lines = ["## Mechanism", "", f"Attention: {attend.__module__}.{attend.__name__} on {device}.", "",
             "### One rounding (the paper's worked example)", ""]
    ex = worked_example()
    print(f"fp32 sum {ex['fp32']:.7f} -> bf16 {ex['bf16']:.5f}, error {ex['error']:+.5f}")
    lines.append(f"The fp32 sum {ex['fp32']:.7f} rounds to **{ex['bf16']:.5f}** in bf16 (error "
                 f"{ex['error']:+.5f}). Its bf16 neighbours are {ex['ulp']:g} apart; the sum lies "
                 f"{abs(ex['fp32'] - ex['midpoint']):.5f} past their midpoint {ex['midpoint']:.6f}, "
                 f"on the side away from zero, so it rounds away from zero by almost half a step.")

    results = tied_rows_experiment(attend, device, **shape)
    ties = sorted({key[2] for key in results})
    figures = [plot_error_histograms(results, hist_k, out / "mechanism_error_hist.png"),
               plot_error_vs_k(results, ties, out / "mechanism_error_vs_k.png")]
    combos = [(p, f) for p in PRECISIONS for f in FIXES]
    lines += ["", "### Rows with k tied maxima (V ~ N(-0.5, 1), dO ~ N(0.5, 1))", "",
              "Mean signed error of O / of delta against float64:", "",
              "| k | " + " | ".join(tag(p, f) for p, f in combos) + " |",
              "|---|" + "---|" * len(combos)]
    for k in ties:
        lines.append(f"| {k} | " + " | ".join(
            f"{results[p, f, k][0].mean():+.2e} / {results[p, f, k][1].mean():+.2e}" for p, f in combos) + " |")

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
