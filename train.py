"""
Train a small character-level GPT in bf16 and watch for the low-precision attention failure of Qiu & Yao (2025): in
flash attention, delta = rowsum(dO * O) carries a one-signed rounding error that grows the attention logits until
the loss blows up (a collapse: a non-finite loss, or a loss spike, SPIKE_NATS below; summary.json says when).

    python train.py --fix off      # plain bf16: collapses (on every seed run: README.md's table)
    python train.py --fix on       # the fix, delta read from the forward's fp32 O: trains through (README.md's table)
    python train.py --fix paper    # the paper's rule (a tied row max shifted up): collapses (README.md's table)
    python train.py --preset tiny --fix on      # a CPU smoke run, through the kernel's emulation: no collapse
    python train.py --fix off --resume          # continue runs/default-kernel-fixoff-s0 from its latest checkpoint

Every setting is a flag; DEFAULT below holds their defaults. The experiments (--help) change the attention's numerics.
A run writes runs/<name>/ (its files: nanolp/runs.py; its name, and which folders a command may write or resume:
nanolp/runconfig.py). A command that cannot run is refused before it writes anything (exit status 2); so is a preset
sized for a GPU on a machine without one, unless --device cpu insists. Ctrl-C stops a run with one line that names its
last checkpoint and the command that continues from it (exit status 130).
"""

import argparse
import csv
import hashlib
import math
import os
import shlex
import sys
import time
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import torch
from tqdm import tqdm

from kernels import FIXES, Numerics
from model import ATTN_BACKENDS, GPT, POSITIONS, GPTConfig, implementation
from nanolp.data import TextError, find_text, get_batch, prepare
from nanolp.diagnostics import PROBE_BATCHES, PROBE_LAYER, diag_columns, diagnose
from nanolp.runconfig import (ARM, NUMERICS, PLAIN_NUMERICS, claim_folder, describe, done, is_finished,
                              nothing_to_resume, resolve_config)
from nanolp.runs import (RunError, checkpoints, checksum_path, checksum_problem, latest_checkpoint, locked,
                         log_outcome, provenance, read_log, set_aside, write_checksum, write_json)

# -----------------------------------------------------------------------------
# The settings: the default preset, the demo. Plain bf16 on TinyShakespeare, the paper's setting at a size where
# the failure comes within minutes on one GPU (how it was chosen: results/default_search/). The model memorises
# the text (train loss ~0.05) and then trains on near-zero gradients; there the one-signed error that O's final
# bf16 cast puts into delta grows layer 0's W_Q and logits until the loss blows up. How often and how soon, per
# arm and seed: README.md's table (every arm: results/README.md's). Each setting is a flag (n_layer: --n-layer);
# --help shows a preset's values.
DEFAULT = dict(
    # the model
    n_layer=6, n_head=6, n_embd=384, block_size=256, pos="learned", qk_norm=False,
    # the attention: our kernel, plain (the fix off, no experiment: nanolp.runconfig.PLAIN_NUMERICS)
    attn="kernel", fix="off", **PLAIN_NUMERICS,
    # training: AdamW, the lr constant after a linear warmup, as the paper trains
    dtype="bf16", seed=0, batch_size=64, steps=200_000, minutes=None,
    lr=1e-3, warmup=100, beta1=0.9, beta2=0.95, weight_decay=0.0, grad_clip=1.0,
    # every N steps: a log row, an evaluation (over eval_iters batches), the diagnostics, a checkpoint
    log_interval=10, eval_interval=1000, eval_iters=20, diag_interval=1000, ckpt_interval=5000,
    # where: run folders, and the text (None: $NANOLP_DATA, else TinyShakespeare)
    out="runs", data=None,
)
PRESETS = {  # the other presets hold only what differs
    "default": DEFAULT,
    # GPT-2 small's shape, the paper's (124M with GPT-2's vocabulary; ours is the text's characters)
    "gpt2": DEFAULT | dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, steps=10_000,
                           eval_interval=250, diag_interval=250, ckpt_interval=250),
    # a CPU smoke run
    "tiny": DEFAULT | dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, lr=3e-3, warmup=20,
                           steps=300, eval_interval=100, eval_iters=4, diag_interval=50, ckpt_interval=100),
}
# what the tiny preset's run is for, said at its end and in analyze.py's report of it
TINY_NOTE = ("the tiny preset checks the pipeline: at this size no collapse is expected (the failure needs the "
             "default preset, on a GPU)")
# -----------------------------------------------------------------------------

# Collapse, the event this project is about, is either of:
#   - a non-finite training loss: the run stops at the next log row, naming the first bad step; no checkpoint is
#     ever written from non-finite state, so the last good one survives.
#   - a loss spike: after warmup, the smoothed training loss rising more than SPIKE_NATS above its running
#     minimum, far beyond training noise (a model that loses a whole nat has thrown away most of what it learned).
#     The run records EXTRA_ROWS more log rows with diagnostics, then stops.
SPIKE_NATS = 1.0   # collapse when the smoothed loss is this far above its minimum
EMA_BETA = 0.95    # smoothing of the training loss for the spike test: an average over ~1/(1-0.95) = 20 steps
EXTRA_ROWS = 3     # log rows still recorded after a spike, to see where it goes
KEEP_CKPTS = 3
DIAG_ROWS = 16     # diagnostic batch rows: the probe holds fp32 (rows, heads, T, T) scores per layer
LOGIT = f"max_logit_L{PROBE_LAYER}"   # the progress bar's and the end's logit: layer 0's, the one that runs away
# A step of the default preset on a CPU, in seconds: 42-50, measured on two cores. Another shape's step is estimated
# from it in proportion to their FLOPs (step_flops).
CPU_STEP_S = (42, 50)
# Dense (no sparsity) bf16 tensor-core peak of one NVIDIA H200 SXM, from NVIDIA's datasheet: 989 TFLOPS.
# MFU is always reported against this number, whatever device the run is on.
H200_BF16_PEAK_FLOPS = 989e12
BASE_COLUMNS = ["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """A malformed flag in one line, as train.py refuses every command that cannot run."""
        print(f"train.py: error: {message}", file=sys.stderr)
        raise SystemExit(2)


class Stopped(Exception):
    """Ctrl-C during training, at a step (the number of steps trained): main says where the run stopped and how to
    continue it."""
    def __init__(self, step):
        super().__init__(step)
        self.step = step


def parse_args(argv):
    return parser(preset_given(argv)).parse_args(argv)


def preset_given(argv):
    """The --preset of a command line (default: "default"), so that --help shows that preset's defaults; a bad
    value is left to the whole parser to refuse."""
    pre = Parser(add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    preset = pre.parse_known_args(argv)[0].preset
    return preset if preset in PRESETS else "default"


def parser(preset="default"):
    """The flags. Every default is None, so that a flag the user gave can be told from one they did not (the
    preset's value); --help shows the values of `preset`, the one on the command line."""
    default = PRESETS[preset]
    def show(key):   # a default as it reads: 200,000
        value = default[key]
        return f" (default {value:,})" if isinstance(value, int) else f" (default {value})"
    p = Parser(
        description="Train a char-level GPT in bf16 and watch flash attention's rounding collapse it (--fix off), "
                    f"or not (--fix on). The defaults shown are the {preset} preset's (--preset tiny --help: the "
                    "tiny preset's). Details: the top of train.py and README.md.")
    demo = p.add_argument_group("the demo")
    demo.add_argument("--fix", choices=FIXES, help="off: plain bf16 flash attention, which collapses; on: the fix, "
                      "the backward's delta read from the forward's fp32 O, which trains through; paper: the paper's "
                      "rule (a tied row max shifted up), which collapses too (with --delta fp32-o: the two together)"
                      + show("fix"))
    demo.add_argument("--attn", choices=ATTN_BACKENDS, help="what computes attention: kernel, our Triton flash "
                      "attention (kernels.py; without a GPU, its PyTorch emulation); emulate, that emulation "
                      "anywhere; sdpa, torch's scaled_dot_product_attention (torch picks its backend), sdpa-flash or "
                      "sdpa-cudnn, one backend of it; fp32, plain attention in fp32, the control that does not "
                      "round. --fix and the experiments apply to kernel and emulate only" + show("attn"))
    demo.add_argument("--seed", type=int, help="seed of the initial weights and of the order of the training "
                                               "batches" + show("seed"))
    demo.add_argument("--steps", type=int, metavar="N", help="training steps, one batch each" + show("steps"))
    demo.add_argument("--minutes", type=float, metavar="M", help="stop after this many minutes of training, "
                                                                 "counted over resumes (default: no limit)")
    demo.add_argument("--data", metavar="FILE", help="the text to train on, UTF-8 (default: $NANOLP_DATA, else "
                      "TinyShakespeare, downloaded on first use; data/README.md)")
    sizes = "; ".join(f"{name}, {what} ({PRESETS[name]['n_layer']} layers of {PRESETS[name]['n_embd']} channels, "
                      f"{PRESETS[name]['steps']:,} steps)" for name, what in (
                          ("default", "the demo, for one GPU"), ("tiny", "a smoke run for a CPU"),
                          ("gpt2", "GPT-2 small's shape")))
    demo.add_argument("--preset", choices=PRESETS, help=f"the model's size and the run's length, which set the "
                                                        f"other defaults: {sizes} (default default)")
    demo.add_argument("--out", metavar="DIR", help="the folder that run folders go in" + show("out"))
    demo.add_argument("--name", help="the run's folder in --out (default: made from the settings that set the run "
                                     "apart from its preset, e.g. default-kernel-fixoff-s0)")
    demo.add_argument("--resume", action="store_true", help="continue the run in --out/--name from its latest "
                      "checkpoint (without --name, the run's own flags make its name)")
    training = p.add_argument_group("training")
    training.add_argument("--lr", type=float, help="learning rate (AdamW), constant after the warmup" + show("lr"))
    training.add_argument("--warmup", type=int, metavar="N", help="steps over which the learning rate rises "
                                                                  "linearly to --lr" + show("warmup"))
    training.add_argument("--batch-size", type=int, metavar="N", help="sequences per step" + show("batch_size"))
    training.add_argument("--dtype", choices=["bf16", "fp32"], help="bf16: the model runs under bfloat16 autocast, "
                          "the setting that fails; fp32: no autocast (with --attn sdpa or fp32 only)" + show("dtype"))
    training.add_argument("--compile", choices=["off", "default", "reduce-overhead"],
                          help="torch.compile's mode; reduce-overhead records CUDA graphs, much faster for a model "
                               "this small (default: reduce-overhead on a GPU, off on a CPU)")
    training.add_argument("--device", help="where to train: cpu, cuda, cuda:1, ... (default: cuda if there is "
                                           "one, else cpu)")
    for interval, what in (("log", "rows of log.csv (the training loss)"), ("eval", "validation losses"),
                           ("diag", "diagnostics (each layer's max attention logit, W_Q and W_K norms, ...: "
                                    "nanolp/diagnostics.py)"),
                           ("ckpt", "checkpoints (the latest 3 kept in ckpt/; --resume starts from the last)")):
        training.add_argument(f"--{interval}-interval", type=int, metavar="N",
                              help=f"steps between {what}" + show(f"{interval}_interval"))
    shape = p.add_argument_group("model shape")
    for dim, what in (("n_layer", "transformer blocks"), ("n_head", "attention heads per block"),
                      ("n_embd", "channels; each head gets n_embd / n_head"),
                      ("block_size", "context length, in characters")):
        shape.add_argument("--" + dim.replace("_", "-"), type=int, metavar="N", help=what + show(dim))
    experiments = p.add_argument_group("experiments", "the attention's numerics (kernels.Numerics; --attn kernel "
                                                      "or emulate only) and the model, to test the mechanism")
    for f in fields(Numerics):   # a flag per field, with the help and values it declares
        experiments.add_argument("--" + f.name.replace("_", "-"), type=f.type, choices=f.metadata["choices"],
                                 help=f.metadata["help"] + show(f.name))
    experiments.add_argument("--pos", choices=POSITIONS, help="positions: learned (GPT-2's table), rope (rotary, "
                             "a modern block's), or none, so that layer 0 sees only characters and every repeat of a "
                             "row's best match ties exactly" + show("pos"))
    experiments.add_argument("--qk-norm", action="store_true", default=None, help="RMSNorm on each head's queries "
                             "and keys, with a learned gain per channel (a modern block's; default off)")
    return p


def get_lr(step, c):
    """Linear warmup, then constant, as the paper trains (a near-constant lr)."""
    return c["lr"] * (step + 1) / c["warmup"] if step < c["warmup"] else c["lr"]


def loss_spike(state, step, c):
    """The loss-spike half of the collapse criterion (above SPIKE_NATS): None, or why it fired."""
    smoothed = state["ema"].item()
    if step > c["warmup"]:
        state["loss_min"] = min(state["loss_min"], smoothed)
    if smoothed > state["loss_min"] + SPIKE_NATS:
        return (f"loss spike: smoothed loss {smoothed:.2f} is {smoothed - state['loss_min']:.2f} nats "
                f"above its minimum {state['loss_min']:.2f}")
    return None


@torch.no_grad()
def evaluate(model, tokens, c, ctx):
    """Validation loss on the same eval_iters batches every time, in every run (seed 0), so runs compare."""
    total = torch.zeros((), device=tokens.device)
    for i in range(c["eval_iters"]):
        x, y = get_batch(tokens, c["batch_size"], c["block_size"], seed=0, step=i)
        with ctx:
            total += model(x, y)[1]
    return (total / c["eval_iters"]).item()


def save_checkpoint(run_dir, model, optimizer, state):
    """Write ckpt/step_XXXXXXX.pt and its checksum, then keep only the newest KEEP_CKPTS. The checkpoint is written
    to a .tmp file and renamed, after its checksum: a run killed at any point leaves either a whole, checked
    checkpoint or none under that name (and what it left half-done goes at the next save)."""
    ckpt_dir = run_dir / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / f"step_{state['step']:07d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    rng = {"cpu": torch.get_rng_state()}   # --stochastic-o draws from torch's generator: resume continues its stream
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state, "rng": rng}, tmp)
    write_checksum(path, tmp)
    os.replace(tmp, path)
    keep = {file.name for ckpt in checkpoints(run_dir)[-KEEP_CKPTS:] for file in (ckpt, checksum_path(ckpt))}
    for file in ckpt_dir.iterdir():
        if file.is_file() and file.name not in keep:   # older checkpoints, and the .tmp and checksum of a killed save
            file.unlink()


def load_checkpoint(run_dir, model, optimizer, device, columns):
    """Restore the newest good checkpoint and drop the log rows written after it (they will be written again). A
    checkpoint that fails its checksum or cannot be read is named in one line, moved to ckpt/damaged/ (set_aside),
    and the one before it tried; RunError if none is good, or if the model does not fit it (config.json edited)."""
    for path in reversed(checkpoints(run_dir)):
        problem = checksum_problem(path)
        if problem is None:
            try:
                ckpt = torch.load(path, map_location=device)
                break
            except Exception as e:   # whatever a damaged file makes torch's zip reader or unpickler raise
                # (torch's message goes on for lines of advice: its first sentence says what failed)
                what = str(e).strip().partition("\n")[0].partition(". ")[0]
                problem = f"it cannot be read ({type(e).__name__}: {what})"
        damaged = set_aside(path)
        print(f"{path}: skipped, {problem}; moved to {damaged}")
    else:   # (no break: none was good)
        raise nothing_to_resume(run_dir)
    if problem := misfit(model, ckpt["model"]):   # before anything is written: the run stays as it was
        raise RunError(f"{run_dir / 'config.json'}: its settings make a model that {path.name} does not fit "
                       f"({problem}): was it edited? Its n_layer, n_embd, block_size, pos and qk_norm must be "
                       f"those the run started with")
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    rng = ckpt.get("rng", {})   # (checkpoints written before it was saved have none)
    if "cpu" in rng:
        torch.set_rng_state(rng["cpu"].cpu())
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"].cpu())
    state = ckpt["state"]
    with open(run_dir / "log.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if int(row["step"]) <= state["step"]]
    write_rows(run_dir / "log.csv", rows, columns, "w")
    return state


def misfit(model, weights):
    """The first tensor in which a model and a checkpoint's weights differ in shape, or that one of them lacks, in
    words; None if the weights fit."""
    shapes = lambda tensors: {name: "x".join(map(str, t.shape)) for name, t in tensors.items()}
    ours, theirs = shapes(model.state_dict()), shapes(weights)
    for name in [*ours, *theirs]:
        if ours.get(name) != theirs.get(name):
            return f"{name}: {theirs.get(name, 'none')} in the checkpoint, {ours.get(name, 'none')} in the model"
    return None


def write_rows(path, rows, columns, mode="a"):
    """Append rows to a log.csv (the file closed after each, so a run stopped at any point has flushed every row it
    wrote), or (mode "w") write the log anew with its header: to a .tmp file, then renamed, so that a run stopped as
    --resume rewrites its log (dropping the rows after its checkpoint) keeps the whole log."""
    written = path.with_name(path.name + ".tmp") if mode == "w" else path
    with open(written, mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        if mode == "w":
            writer.writeheader()
        writer.writerows(rows)
    if mode == "w":
        os.replace(written, path)


def write_summary(run_dir, c, collapse):
    """summary.json, from log.csv (so a resumed run summarises all of itself: nanolp.runs.log_outcome, which also
    reads runs that ended without one) and the collapse, if any."""
    outcome = log_outcome(read_log(run_dir / "log.csv"))
    device = torch.device(c["device"])
    summary = dict(
        collapsed=collapse is not None,
        collapse_step=(collapse or {}).get("step"),
        collapse_minute=(collapse or {}).get("minute"),
        reason=(collapse or {}).get("reason"),
        **outcome,   # steps, minutes, final losses (None after a non-finite loss), max logit, tokens/s
        mfu=c["flops_per_token"] * (outcome["tokens_per_s"] or 0.0) / H200_BF16_PEAK_FLOPS,
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        name=c["name"], **{k: c[k] for k in ARM}, data_sha1=c["data_sha1"],   # the arm, whole
        provenance=provenance(),   # of this invocation (a resumed run's config.json keeps its first one's)
    )
    write_json(run_dir / "summary.json", summary)
    return summary


def step_flops(c):
    """A step's training FLOPs with settings c, as model.GPT.flops_per_token counts them but without the embeddings
    (their size is the text's vocabulary, not read yet, and a small part): 6 x 12 n_embd^2 weights per layer, and
    the attention's 12 n_embd T, per token."""
    d, T = c["n_embd"], c["block_size"]
    return c["batch_size"] * T * c["n_layer"] * (72 * d * d + 12 * d * T)


def span(low, high):
    """Seconds from low to high in words, in the largest unit that high holds at least twice: 42-50 s, 97-116 days."""
    units = (("days", 86400), ("hours", 3600), ("minutes", 60))
    unit, size = next(((unit, size) for unit, size in units if high >= 2 * size), ("s", 1))
    digits = 0 if high >= 10 * size else 1
    return f"{low / size:,.{digits}f}-{high / size:,.{digits}f} {unit}"


def refuse_what_this_machine_cannot_run(c, args):
    """RunError, before anything is built, for a GPU without bf16 (compute capability below 8.0: a T4, a V100), where
    bf16 training cannot run; and for a preset sized for a GPU on a machine without CUDA: there a step takes most of
    a minute and a run months. An explicit --device cpu trains it anyway, and --resume continues a run on the
    device it ran on (its config.json's)."""
    if c["device"].startswith("cuda") and c["dtype"] == "bf16" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(c["device"])
        if major < 8:
            raise RunError(f"this GPU ({torch.cuda.get_device_name(c['device'])}, compute capability {major}.{minor}) "
                           f"has no bf16, the precision whose failure this project trains: it takes compute "
                           f"capability 8.0 or later (an A100, RTX 30xx or 40xx, L4, H100); on this machine's CPU: "
                           f"python train.py --preset tiny --device cpu")
    if c["preset"] == "tiny" or c["device"] != "cpu" or args.device is not None or args.resume:
        return
    step = [seconds * step_flops(c) / step_flops(DEFAULT) for seconds in CPU_STEP_S]
    tiny = "python train.py --preset tiny" + (f" --fix {args.fix}" if args.fix else "")
    raise RunError(f"the {c['preset']} preset is sized for a GPU and this machine has no CUDA device: a step takes "
                   f"about {span(*step)} on two CPU cores, its {c['steps']:,} steps "
                   f"{span(*(seconds * c['steps'] for seconds in step))} (--device cpu trains it here anyway); a smoke "
                   f"run of about a minute: {tiny}")


def main(argv=None):
    """The command line. A command that cannot run as given (a setting, the text, the run folder) is refused before
    it writes anything, as argparse refuses a malformed flag: one line per problem on stderr, exit status 2."""
    args = parse_args(argv)
    try:
        c = resolve_config(args, PRESETS)
        refuse_what_this_machine_cannot_run(c, args)
        run_dir = Path(c["out"]) / c["name"]
        text = find_text(c["data"])
        sha1 = hashlib.sha1(text.read_bytes()).hexdigest()
        if c.get("data_sha1", sha1) != sha1:   # (only a resumed run has one already)
            raise RunError(f"--resume {run_dir}: the text {text} has changed since the run started "
                           f"(sha1 {c['data_sha1'][:12]}, now {sha1[:12]})")
        c["data_sha1"] = sha1
        data = prepare(text, block_size=c["block_size"])
        with locked(run_dir):   # no other run writes the folder while this one does
            claim_folder(run_dir, c, args.resume, PRESETS)
            return run(c, data, args.resume)
    except (RunError, TextError) as e:
        for line in str(e).splitlines():
            print(f"train.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as e:   # (the run folder's lock is let go by now)
        print(f"train.py: {stopped(run_dir, c, e.step)}", file=sys.stderr)
        raise SystemExit(130) from None   # 128 + SIGINT, the status a shell gives a command that Ctrl-C ended


def stopped(run_dir, c, step):
    """What a run that Ctrl-C stopped at `step` says, in one line: its last checkpoint, and the command that
    continues from it (--out and --name find the run; its config.json holds the rest of its settings)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return (f"stopped at step {step}, before the run's first checkpoint (every {c['ckpt_interval']:,} steps): "
                f"nothing to resume; the same command starts the run again")
    resume = shlex.join(["python", "train.py", "--resume", "--out", c["out"], "--name", c["name"]])
    return f"stopped at step {step}; last checkpoint {ckpt}; to continue from it: {resume}"


def run(c, data, resume):
    """Set up the run that c describes in its folder (on resume from its latest checkpoint), train it (train) and
    summarise it; returns its summary."""
    run_dir = Path(c["out"]) / c["name"]
    device = torch.device(c["device"])
    B, T = c["batch_size"], c["block_size"]
    tokens = data.train.long().to(device), data.val.long().to(device)
    # the model and its optimizer
    torch.manual_seed(c["seed"])  # the initial weights; the data order depends on (seed, step) only
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"],
                          n_embd=c["n_embd"], attn=c["attn"], fix=c["fix"],
                          numerics=Numerics(**{k: c[k] for k in NUMERICS}), pos=c["pos"], qk_norm=c["qk_norm"])).to(device)
    c["vocab_size"], c["flops_per_token"] = data.vocab_size, model.flops_per_token()
    # weight decay, when asked for, on matrices only (not on biases and LayerNorm gains), as in GPT-2
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=device.type == "cuda")
    columns = BASE_COLUMNS + diag_columns(c["n_layer"], c["n_head"], c["qk_norm"])

    # the loop's whole state: a checkpoint of it (with model and optimizer) continues the run exactly
    state = dict(step=0, elapsed=0.0, ema=None, loss_min=math.inf)
    if resume:
        state = load_checkpoint(run_dir, model, optimizer, device, columns)
        # (a run killed after its last checkpoint but before its summary resumes to write that summary)
        if (run_dir / "summary.json").exists() and is_finished(c, state["step"], state["elapsed"] / 60):
            raise RunError(f"--resume: {run_dir}: {done(state['step'])}; give a larger --steps or --minutes to "
                           f"train it further")
        print(f"resuming {run_dir} at step {state['step']}")
    else:   # (claim_folder made sure that the folder holds no run)
        write_rows(run_dir / "log.csv", [], columns, "w")
    c.setdefault("provenance", provenance())   # (kept from the run's start on --resume)
    c["attn_impl"] = implementation(c["attn"], device.type)   # what computes attn here: on a CPU, kernel's emulation
    write_json(run_dir / "config.json", c)
    print(f"{run_dir}: {describe(c, PRESETS)}; {sum(p.numel() for p in params) / 1e6:.2f}M parameters, "
          f"{c['flops_per_token'] / 1e6:.1f} MFLOPs/token, on {device}")

    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bf16" else nullcontext()
    # diagnostics use the plain model (hooks)
    train_model = model if c["compile"] == "off" else torch.compile(model, mode=c["compile"])
    # the diagnostics' batches: one of the validation text, and delta_probe's rows: fixed batches of the training
    # text, where the memorised model's gradient is tiny (the regime the curvature effect is about); 10**6 is a
    # seed no run uses, so they are not a run's own batches
    diag = (*get_batch(tokens[1], min(B, DIAG_ROWS), T, seed=0, step=0),
            [get_batch(tokens[0], B, T, seed=10**6, step=i) for i in range(PROBE_BATCHES)])

    collapse = train(c, run_dir, model, train_model, optimizer, state, ctx, tokens, diag, columns)
    summary = write_summary(run_dir, c, collapse)
    print_outcome(run_dir, c, summary)
    return summary


def train(c, run_dir, model, train_model, optimizer, state, ctx, tokens, diag, columns):
    """The training loop, from state["step"] until c["steps"], c["minutes"] or a collapse: a row of log.csv every
    log interval, a checkpoint every checkpoint interval and at the end. train_model is model, maybe compiled;
    tokens the training and validation text; diag the diagnostics' batch (x, y) and probe batches. Returns the
    collapse (its step, minute and reason) or None; Ctrl-C raises Stopped, with the steps trained."""
    train_tokens, val_tokens = tokens
    diag_x, diag_y, probe = diag
    device = train_tokens.device
    B, T = c["batch_size"], c["block_size"]
    step, collapse, stop_at = state["step"], None, c["steps"]
    loss_sum, grad_sum, n_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
    bad_step = torch.full((), -1, device=device)  # first step with a non-finite loss, tracked without a sync
    t_start = t_row = time.time()
    elapsed0 = state["elapsed"]
    pbar = tqdm(total=c["steps"], initial=step, dynamic_ncols=True)
    logit = None   # LOGIT at the last diagnostics, for the progress bar
    try:
        while step < stop_at:
            # the step: forward, backward, clip, update
            lr = get_lr(step, c)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = get_batch(train_tokens, B, T, c["seed"], step)
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may now reuse the last step's output buffers
            with ctx:
                _, loss = train_model(x, y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # bookkeeping, on the device: no host sync until the next log row
            loss = loss.detach()
            bad_step = torch.where(torch.isfinite(loss) | (bad_step >= 0), bad_step, step)
            state["ema"] = loss.clone() if state["ema"] is None else state["ema"].lerp(loss, 1 - EMA_BETA)
            loss_sum += loss
            grad_sum += grad_norm
            n_acc += 1
            step += 1
            pbar.update()
            elapsed = elapsed0 + time.time() - t_start
            if c["minutes"] is not None and elapsed >= 60 * c["minutes"]:
                stop_at = step
            intervals = ("log_interval", "eval_interval", "diag_interval", "ckpt_interval")
            if not (step >= stop_at or any(step % c[k] == 0 for k in intervals)):
                continue

            # a log row: the losses, the collapse test, an evaluation and diagnostics when due
            train_loss = (loss_sum / n_acc).item()  # the loop's one host sync
            tokens_per_s = n_acc * B * T / (time.time() - t_row)
            row = dict(step=step, elapsed_s=round(elapsed, 2), tokens=step * B * T, lr=lr, train_loss=train_loss,
                       grad_norm=(grad_sum / n_acc).item(), tokens_per_s=round(tokens_per_s, 1),
                       mfu=c["flops_per_token"] * tokens_per_s / H200_BF16_PEAK_FLOPS)
            bad = bad_step.item()
            reason = f"non-finite loss at step {bad}" if bad >= 0 else loss_spike(state, step, c)
            if reason and collapse is None:
                collapse = dict(step=bad if bad >= 0 else step, minute=elapsed / 60, reason=reason)
                stop_at = min(stop_at, step + EXTRA_ROWS * c["log_interval"])
                tqdm.write(f"collapse at step {collapse['step']}: {reason}")
            if bad >= 0:
                stop_at = step  # the weights are poisoned: no eval, no diagnostics, no checkpoint
            else:
                if step % c["eval_interval"] == 0 or step >= stop_at:
                    row["val_loss"] = evaluate(train_model, val_tokens, c, ctx)
                if step % c["diag_interval"] == 0 or step >= stop_at or collapse:  # every row once collapsed
                    row.update(diagnose(model, diag_x, diag_y, ctx, probe, seed=step))  # a fresh probe draw per row
                    logit = row[LOGIT]
            write_rows(run_dir / "log.csv", [row], columns)
            pbar.set_postfix({"loss": f"{train_loss:.4f}", LOGIT: "-" if logit is None else f"{logit:.4g}"})

            # a checkpoint: only finite, pre-collapse state is saved; also at the end, so that --resume continues
            if collapse is None and (step % c["ckpt_interval"] == 0 or step >= stop_at):
                state.update(step=step, elapsed=elapsed)
                save_checkpoint(run_dir, model, optimizer, state)
            loss_sum.zero_(), grad_sum.zero_()   # the next row's sums and time (which counts this row's work)
            n_acc, t_row = 0, time.time()
    except KeyboardInterrupt:   # Ctrl-C: what the run wrote is whole (a log row, a checkpoint: save_checkpoint)
        pbar.close()
        raise Stopped(step) from None
    pbar.close()
    return collapse


def print_outcome(run_dir, c, summary):
    """The run's end in a few plain lines; summary.json holds the whole outcome and arm."""
    if summary["collapsed"]:
        print(f"collapsed at step {summary['collapse_step']:,}, after {summary['collapse_minute']:.1f} training "
              f"minutes: {summary['reason']}")
    else:
        print(f"no collapse in {summary['steps']:,} steps ({summary['minutes']:.1f} training minutes)")
    if c["preset"] == "tiny":
        print(TINY_NOTE)
    logits = [v for v in read_log(run_dir / "log.csv").get(LOGIT, []) if math.isfinite(v)]
    if logits:
        print(f"layer {PROBE_LAYER}'s max attention logit peaked at {max(logits):.4g}")
    print(f"run folder: {run_dir} (summary.json: the outcome and every setting)")
    print(f"next: python analyze.py {c['out']}   (figures and report.md of the runs in {c['out']}, written to "
          f"{Path(c['out']) / 'figures'})")


if __name__ == "__main__":
    main()
