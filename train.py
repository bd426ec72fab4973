"""
Train a small character-level GPT and watch for the low-precision attention failure of Qiu & Yao (2025): in bf16
flash attention, delta = rowsum(dO * O) carries a one-signed rounding error that grows the attention logits
until the loss blows up.

    python train.py --fix off      # plain bf16: collapses at step ~95,000 on the H200, ~10-12 min alone
    python train.py --fix on       # the complete fix: trains through, 152,000 steps measured on seed 0
    python train.py --fix paper    # the paper's rule alone (the row-max shift): collapsed on seeds 0 and 1
    python train.py --preset tiny --attn sdpa   # a CPU smoke run
    python train.py --fix off --resume          # continue runs/default-kernel-fixoff-s0 from its latest checkpoint

Experiments, each a flag of --help's "experiments" group, change the attention's numerics or the model to test
the mechanism (all but --pos only in our kernel, --attn kernel or emulate):

    python train.py --fix off --delta-from-p       # delta = rowsum(dP * P), the paper's control: no collapse
    python train.py --fix off --delta-fp32         # delta from the forward's fp32 O (no shift): no collapse
    python train.py --fix off --stochastic-o forward   # O rounded stochastically (unbiased) in the forward;
                                                   # --stochastic-o delta: only the O that delta reads
    python train.py --precision paper              # the accumulator rounded to bf16 per tile, as in the paper
    python train.py --fix off --mantissa-bits 3    # the amplifier: P rounded to 3 mantissa bits before P V
                                                   # (--amplify vo: V and O instead)
    python train.py --pos none                     # no position embeddings: layer 0's repeated tokens tie exactly

Measured on the default preset: delta from P trained 242,864 steps (seed 0) and delta from the fp32 O over
123,000 steps (seeds 0 and 1) without a collapse; --precision paper collapsed on each of seeds 0-3.

A run writes runs/<name>/: config.json (every resolved setting), log.csv (one row per log interval, with the
diagnostics of nanolp/diagnostics.py every --diag-interval steps), summary.json (the outcome and the whole arm:
every setting of ARM) and ckpt/ (the last 3 checkpoints).

Runs never mix. The default name is <preset>-<attn>-fix<fix>, then a suffix for each setting of ARM that differs
from the preset's (-delta_fp32, -lr0.003, -bits3, ...), then -s<seed>: default-kernel-fixoff-delta_fp32-s0. A name
longer than MAX_NAME characters puts a hash of those settings in place of their suffixes. A new run refuses a
folder that holds a run's result (a checkpoint or summary.json) and replaces an attempt that stopped before its
first checkpoint. --resume continues a run with its own config.json and refuses a flag of ARM that differs from it
(and a text whose content changed); --steps, --minutes, the intervals, --device and --compile may change. A
collapsed run is not resumed: the collapse is its result. No command touches a folder that a live run is writing
(its lock file holds the run's process id).

A command that cannot run (a bad setting or text, a folder it may not write) is refused before it writes
anything: one line per problem on stderr, exit status 2, as argparse does for a malformed flag.

Collapse, the event this project is about, is either of:
  - a non-finite training loss. The run stops at the next log row, naming the first bad step; no checkpoint
    is ever written from non-finite state, so the last good one survives.
  - a loss spike: after warmup, the smoothed training loss (an exponential average over about 20 steps)
    rising more than SPIKE_NATS = 1.0 nat above its running minimum, far beyond training noise: a model that
    loses a whole nat has thrown away most of what it learned. The run records 3 more log rows with
    diagnostics, then stops.
Either way summary.json says when and why.
"""

import argparse
import csv
import hashlib
import json
import math
import os
import re
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import fields
from pathlib import Path

import torch
from tqdm import tqdm

from kernels import Numerics
from model import ATTN_BACKENDS, GPT, H200_BF16_PEAK_FLOPS, GPTConfig, implementation
from nanolp.data import TextError, find_text, get_batch, prepare
from nanolp.diagnostics import PROBE_BATCHES, diag_columns, diagnose
from nanolp.presets import ARM, COMMON, FIX, NAMED, NUMERICS, PRESETS, changed_settings, check_config, flag
from nanolp.runs import RunError, latest_checkpoint, locked, log_outcome, provenance, read_json, read_log

# a setting in a name: -<label><number>, -<label>_<word>, -<label> for a switch that is on (-no_<label>: off)
LABELS = dict(mantissa_bits="bits", block_size="block", batch_size="batch", weight_decay="wd", grad_clip="clip")
MAX_NAME = 80
SPIKE_NATS = 1.0   # collapse when the smoothed loss is this far above its minimum (see the docstring)
EMA_BETA = 0.95    # smoothing of the training loss for the spike test: an average over ~1/(1-0.95) = 20 steps
EXTRA_ROWS = 3     # log rows still recorded after a spike, to see where it goes
KEEP_CKPTS = 3
DIAG_ROWS = 16     # diagnostic batch rows: the probe holds fp32 (rows, heads, T, T) scores per layer
BASE_COLUMNS = ["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # every default is None, so that a flag the user gave can be told from one they did not (the preset's value)
    demo = p.add_argument_group("the demo")
    demo.add_argument("--fix", choices=list(FIX),
                      help="off: plain bf16 (default); on: the complete fix, the paper's row-max shift and delta "
                           "from the forward's fp32 O; paper: the paper's rule alone")
    demo.add_argument("--attn", choices=ATTN_BACKENDS, help="the attention (model.py; default kernel)")
    demo.add_argument("--seed", type=int, help="initial weights and data order (default 0)")
    demo.add_argument("--steps", type=int, help="step target (default: the preset's)")
    demo.add_argument("--minutes", type=float, help="training-time budget, counted over resumes; the run stops at "
                                                    "whichever of steps/minutes comes first")
    demo.add_argument("--data", help="a UTF-8 text file (default $NANOLP_DATA, else TinyShakespeare)")
    demo.add_argument("--preset", choices=PRESETS, help="default: the demo; tiny: a CPU smoke run; gpt2: GPT-2 "
                                                        "small's shape")
    demo.add_argument("--out", help="folder of run folders (default runs/)")
    demo.add_argument("--name", help="run folder name (default: from the settings, see above)")
    demo.add_argument("--resume", action="store_true",
                      help="continue the run from its latest checkpoint, with the settings it has")
    training = p.add_argument_group("training")
    training.add_argument("--lr", type=float, help="learning rate, constant after the warmup")
    training.add_argument("--warmup", type=int, help="steps of linear lr warmup")
    training.add_argument("--batch-size", type=int)
    training.add_argument("--dtype", choices=["bf16", "fp32"],
                          help="bf16 autocast (default) or plain fp32 (fp32 needs --attn sdpa or fp32)")
    training.add_argument("--compile", choices=["off", "default", "reduce-overhead"],
                          help="torch.compile mode (default: reduce-overhead, i.e. CUDA graphs, on cuda; off on cpu)")
    training.add_argument("--device", help="default cuda if available, else cpu")
    for interval, what in (("log", "log rows"), ("eval", "val losses"), ("diag", "diagnostics"),
                           ("ckpt", "checkpoints")):
        training.add_argument(f"--{interval}-interval", type=int, help=f"steps between {what}")
    shape = p.add_argument_group("model shape (default: the preset's)")
    for dim in ("n-layer", "n-head", "n-embd", "block-size"):
        shape.add_argument(f"--{dim}", type=int)
    experiments = p.add_argument_group("experiments", "variants of the numerics and the model that test the "
                                                      "mechanism (all but --pos only in attn kernel or emulate)")
    for f in fields(Numerics):   # our attention's numerics: a flag per field, with the help and values it declares
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            experiments.add_argument(flag, action=argparse.BooleanOptionalAction, help=f.metadata["help"])
        else:
            experiments.add_argument(flag, type=f.type, choices=f.metadata["choices"], help=f.metadata["help"])
    experiments.add_argument("--pos", choices=["learned", "none"],
                             help="position embeddings; none: layer 0 sees tokens only, so repeated tokens tie")
    return p.parse_args(argv)


def suffix(key, value):
    """How a run name spells one setting (LABELS)."""
    label = LABELS.get(key, key)
    if isinstance(value, bool):
        return label if value else f"no_{label}"
    if isinstance(value, (int, float)):
        return f"{label}{'_' if label[-1].isdigit() else ''}{value!r}"   # repr: the shortest exact spelling
    if key == "data" and value is not None:
        text = Path(value)
        value = text.parent.name if text.stem == "input" else text.stem   # as nanolp/data.py names its cache
    return label + "_" + re.sub(r"[^\w.+-]", "_", str(value))


def run_name(c):
    """The default name: <preset>-<attn>-fix<fix>, a suffix per changed setting, -s<seed> (as nanolp/sweep.py
    ends its names, so the arm is the name less -s<seed>); past MAX_NAME characters a hash replaces the suffixes."""
    changed = changed_settings(c)
    head, tail = f"{c['preset']}-{c['attn']}-fix{c['fix']}", f"-s{c['seed']}"
    name = head + "".join(f"-{suffix(k, v)}" for k, v in changed.items()) + tail
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{head}-{digest}{tail}"
    return name


def describe(c):
    """A run's arm in words: its NAMED settings and the ones that differ from its preset (and, where attn kernel
    runs as its emulation, that)."""
    settings = {k: c.get(k) for k in NAMED} | changed_settings(c)
    if c.get("attn_impl", c["attn"]) != c["attn"]:
        settings["attn"] = f"{c['attn']} (on {c['device']}: its PyTorch emulation, nanolp/emulate.py)"
    return ", ".join(f"{k} {v}" for k, v in settings.items())


def resolve_config(args):
    """The run's settings: COMMON, then the preset, then the flags given, checked (check_config). On --resume the
    run's own config.json replaces COMMON and the preset (COMMON only fills in settings added after the run
    started), and a flag of ARM that differs from it is refused. RunError names every problem."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    if "data" not in given and os.environ.get("NANOLP_DATA"):
        given["data"] = os.environ["NANOLP_DATA"]   # the text is part of the arm: recorded as if --data gave it
    if "data" in given:
        given["data"] = str(Path(given["data"]).resolve())   # one spelling per file, from wherever train.py runs
    preset = given.get("preset", "default")
    config = {**COMMON, **PRESETS[preset], "preset": preset, **given}
    config.setdefault("name", run_name(config))
    problems = []
    if args.resume:
        run_dir = Path(config["out"]) / config["name"]
        saved = read_json(run_dir / "config.json")
        if not saved:
            raise RunError(f"--resume: no run at {run_dir} (no config.json)")
        ran = {**COMMON, **saved}
        problems += [f"--resume {run_dir}: {flag(k)}: the run has {ran.get(k)!r}, this command {given[k]!r}, which "
                     f"would change its numerics or data order (leave it out to continue the run as it was, or "
                     f"start a new run without --resume)" for k in ARM if k in given and given[k] != ran.get(k)]
        config = {**ran, **given}
    config.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    # CUDA graphs: without them a step of a model this small waits on kernel launches
    config.setdefault("compile", "reduce-overhead" if config["device"].startswith("cuda") else "off")
    problems += check_config(config)
    if problems:
        raise RunError("\n".join(problems))
    return config


def claim_folder(run_dir, c, resume):
    """Refuse (RunError) unless this command may write run_dir, whose lock it holds. A checkpoint or a summary.json
    is a run's result, never replaced: a new run refuses such a folder, and --resume continues it, unless it
    collapsed (the collapse is the result; continuing would write over it). An attempt that stopped before its
    first checkpoint has nothing to continue: a new run replaces it."""
    ckpt, summary = latest_checkpoint(run_dir), read_json(run_dir / "summary.json")
    collapse = (f"it collapsed at step {summary.get('collapse_step')} ({summary.get('reason')})"
                if summary.get("collapsed") else None)
    if resume:
        if collapse:
            raise RunError(f"--resume: {run_dir} is kept as it ended: {collapse}; start a new run with another --name")
        if ckpt is None:
            raise RunError(f"--resume: no checkpoint in {run_dir / 'ckpt'} (the run stopped before its first): leave "
                           f"out --resume to start it afresh")
    elif ckpt or summary:
        saved = read_json(run_dir / "config.json")
        if not saved:
            raise RunError(f"{run_dir} holds a run without config.json: pass --name for a new run")
        ran = {**COMMON, **saved}
        differ = [f"{k} {c[k]!r} (the run: {ran.get(k)!r})" for k in ARM if c[k] != ran.get(k)]
        advice = (f"this command differs in {', '.join(differ)}: give it another --name (--resume would refuse)"
                  if differ else f"{collapse}: give a new run another --name" if collapse else
                  "pass --resume to continue it, or --name for a new run")
        raise RunError(f"{run_dir} exists, a run of {describe(ran)}: {advice}")
    else:
        attempt = [run_dir / name for name in ("config.json", "log.csv", "ckpt") if (run_dir / name).exists()]
        if attempt:
            print(f"{run_dir}: replacing an attempt that stopped before its first checkpoint (no checkpoint, "
                  f"no summary.json)")
        for path in attempt:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def get_lr(step, c):
    """Linear warmup, then constant, as the paper trains (a near-constant lr)."""
    return c["lr"] * (step + 1) / c["warmup"] if step < c["warmup"] else c["lr"]


def loss_spike(state, step, c):
    """The loss-spike half of the collapse criterion (see the top of this file): None, or why it fired."""
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
    """Write ckpt/step_XXXXXXX.pt atomically and keep only the newest KEEP_CKPTS."""
    ckpt_dir = run_dir / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / f"step_{state['step']:07d}.pt"
    rng = {"cpu": torch.get_rng_state()}   # --stochastic-o draws from torch's generator: resume continues its stream
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state, "rng": rng},
               f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-KEEP_CKPTS]:
        old.unlink()


def load_checkpoint(run_dir, model, optimizer, device, columns):
    """Restore the newest checkpoint and drop the log rows written after it (they will be written again)."""
    ckpt = torch.load(latest_checkpoint(run_dir), map_location=device)
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


def write_rows(path, rows, columns, mode="a"):
    with open(path, mode, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        if mode == "w":
            writer.writeheader()
        writer.writerows(rows)


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
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None):
    """The command line. A command that cannot run as given (a setting, the text, the run folder) is refused before
    it writes anything, as argparse refuses a malformed flag: one line per problem on stderr, exit status 2."""
    args = parse_args(argv)
    try:
        c = resolve_config(args)
        run_dir = Path(c["out"]) / c["name"]
        text = find_text(c["data"])
        sha1 = hashlib.sha1(text.read_bytes()).hexdigest()
        if c.get("data_sha1", sha1) != sha1:   # (only a resumed run has one already)
            raise RunError(f"--resume {run_dir}: the text {text} has changed since the run started "
                           f"(sha1 {c['data_sha1'][:12]}, now {sha1[:12]})")
        c["data_sha1"] = sha1
        data = prepare(text, block_size=c["block_size"])
        with locked(run_dir):   # no other run writes the folder while this one does
            claim_folder(run_dir, c, args.resume)
            return run(c, data, args.resume)
    except (RunError, TextError) as e:
        for line in str(e).splitlines():
            print(f"train.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None


def run(c, data, resume):
    """Train the run that c describes, in its folder (on resume from its latest checkpoint); returns its summary."""
    run_dir = Path(c["out"]) / c["name"]
    device = torch.device(c["device"])
    B, T = c["batch_size"], c["block_size"]
    train_tokens, val_tokens = data.train.long().to(device), data.val.long().to(device)
    torch.manual_seed(c["seed"])  # the initial weights; the data order depends on (seed, step) only
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"],
                          n_embd=c["n_embd"], attn=c["attn"], fix=FIX[c["fix"]],
                          numerics=Numerics(**{k: c[k] for k in NUMERICS}), pos=c["pos"])).to(device)
    c["vocab_size"], c["flops_per_token"] = data.vocab_size, model.flops_per_token()
    # weight decay, when asked for, on matrices only (not on biases and LayerNorm gains), as in GPT-2
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=device.type == "cuda")
    columns = BASE_COLUMNS + diag_columns(c["n_layer"], c["n_head"])

    # the loop's whole state: a checkpoint of it (with model and optimizer) continues the run exactly
    state = dict(step=0, elapsed=0.0, ema=None, loss_min=math.inf)
    if resume:
        state = load_checkpoint(run_dir, model, optimizer, device, columns)
        print(f"resuming {run_dir} at step {state['step']}")
    else:   # (claim_folder made sure that the folder holds no run)
        write_rows(run_dir / "log.csv", [], columns, "w")
    c.setdefault("provenance", provenance())   # (kept from the run's start on --resume)
    c["attn_impl"] = implementation(c["attn"], device.type)   # what computes attn here: on a CPU, kernel's emulation
    (run_dir / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    print(f"{run_dir}: {describe(c)}; {sum(p.numel() for p in params) / 1e6:.2f}M parameters, "
          f"{c['flops_per_token'] / 1e6:.1f} MFLOPs/token, on {device}")
    if device.type == "cpu" and c["preset"] != "tiny":
        print("note: this preset is sized for a GPU; on a CPU one step can take many seconds "
              "(try --preset tiny, or --dtype fp32 --attn sdpa)")

    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bf16" else nullcontext()
    # diagnostics use the plain model (hooks)
    train_model = model if c["compile"] == "off" else torch.compile(model, mode=c["compile"])
    diag_x, diag_y = get_batch(val_tokens, min(B, DIAG_ROWS), T, seed=0, step=0)
    # delta_probe's rows: fixed batches of the training text, where the memorised model's gradient is tiny (the
    # regime the curvature effect is about); 10**6 is a seed no run uses, so they are not a run's own batches
    probe = [get_batch(train_tokens, B, T, seed=10**6, step=i) for i in range(PROBE_BATCHES)]
    nan_at = int(os.environ.get("NANOLP_NAN_AT_STEP", -1))  # test hook: poison the loss of this step

    step, collapse, stop_at = state["step"], None, c["steps"]
    loss_sum, grad_sum, n_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
    bad_step = torch.full((), -1, device=device)  # first step with a non-finite loss, tracked without a sync
    t_start = t_row = time.time()
    elapsed0 = state["elapsed"]
    pbar = tqdm(total=c["steps"], initial=step, dynamic_ncols=True)
    max_logit = None
    while step < stop_at:
        lr = get_lr(step, c)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_tokens, B, T, c["seed"], step)
        torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may now reuse the last step's output buffers
        with ctx:
            _, loss = train_model(x, y)
        if step == nan_at:
            loss = loss * math.nan
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        # bookkeeping on the device: no host sync until the next log row
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

        # a log row
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
                row.update(diagnose(model, diag_x, diag_y, ctx, probe))
                max_logit = max(row[f"max_logit_L{i}"] for i in range(c["n_layer"]))
        write_rows(run_dir / "log.csv", [row], columns)
        pbar.set_postfix(loss=f"{train_loss:.4f}", max_logit="-" if max_logit is None else f"{max_logit:.1f}")
        # only finite, pre-collapse state is saved; also at the end, so that --resume continues from there
        if collapse is None and (step % c["ckpt_interval"] == 0 or step >= stop_at):
            state.update(step=step, elapsed=elapsed)
            save_checkpoint(run_dir, model, optimizer, state)
        loss_sum.zero_(), grad_sum.zero_()
        n_acc, t_row = 0, time.time()
    pbar.close()

    summary = write_summary(run_dir, c, collapse)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
