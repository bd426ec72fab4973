"""
Train a small character-level GPT and watch for the low-precision attention failure of Qiu & Yao (2025).

    python train.py --fix off                    # plain bf16: the loss went non-finite at step ~95,000 (~10 min)
    python train.py --fix off --delta-from-p     # the paper's control: the same run trains normally
    python train.py --fix off --delta-fp32       # delta from an fp32 copy of O: trains normally too (2 of 2 seeds)
    python train.py --fix on                     # the same run with the fix: it collapsed too (2 of 2 seeds)
    python train.py --fix off --mantissa-bits 3 --diag-interval 250   # amplified (P at 3 bits): ~7,000 steps
    python train.py --preset tiny --attn sdpa    # a CPU smoke run, about a minute
    python train.py --fix off --resume           # continue runs/<name> from its latest checkpoint

A run writes runs/<name>/: config.json (every resolved setting), log.csv (one row per log interval, with the
diagnostics of nanolp/diagnostics.py every --diag-interval steps), summary.json, and ckpt/ (the last 3
checkpoints). Flags override the preset; on --resume, flags override the run's saved config.json.

Collapse, the event this project is about, is either of:
  - a non-finite training loss. The run stops at the next log row, naming the first bad step; no checkpoint
    is ever written from non-finite state, so the last good one survives.
  - a loss spike: after warmup, the smoothed training loss (an exponential average over about 20 steps)
    rising more than SPIKE_NATS = 1.0 nat above its running minimum. Ordinary training noise in that average
    is a few hundredths of a nat and ordinary loss spikes recover within a fraction of a nat, while a
    char-level model at 1.0-1.5 nats that loses a whole nat has thrown away most of what it learned (the
    paper's collapse goes from ~3 to >7). The run records 3 more log rows with diagnostics, then stops.
Either way summary.json says when and why.
"""

import argparse
import csv
import json
import math
import os
import statistics
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from model import ATTN_BACKENDS, GPT, H200_BF16_PEAK_FLOPS, GPTConfig
from nanolp.data import get_batch, prepare
from nanolp.diagnostics import PROBE_BATCHES, diag_columns, diagnose

COMMON = dict(
    fix="off", attn="kernel", precision="fa2", delta_from_p=False, delta_fp32=False, mantissa_bits=0, amplify="p",
    stochastic_o="off",
    pos="learned", seed=0,
    lr=1e-3, warmup=100, schedule="constant", beta1=0.9, beta2=0.95, weight_decay=0.0, grad_clip=1.0,
    steps=5000, minutes=None, dtype="bf16",
    log_interval=10, eval_interval=250, eval_iters=20, diag_interval=250, ckpt_interval=250,
    out="runs", data=None,
)
PRESETS = {
    # Plain bf16, the paper's setting, on TinyShakespeare (README.md, "How we found the default"). The model
    # memorises the text within ~20,000 steps and then trains on near-zero gradients; there the one-signed error
    # of delta = rowsum(dO * O) grows layer 0's W_Q and logits, and with the fix off the loss went non-finite at
    # step 94,798 (10.3 minutes on one H200 with CUDA graphs; seed 1: 110,503). delta = rowsum(dP * P), the
    # paper's control (--delta-from-p), trained 242,864 steps with layer 0's max logit flat at ~10. The fix
    # (--fix on) did not prevent it (seeds 0 and 1: steps 69,890 and 121,201): the error that fails it is O's
    # final bf16 cast (delta read from an fp32 O trained 123,000+ steps on both seeds), not the tie bias.
    "default": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, steps=200_000,
                    eval_interval=1000, diag_interval=1000, ckpt_interval=5000),
    # the paper's GPT-2 small shape (124M with GPT-2's vocabulary; ours is the text's characters)
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=64, steps=10000),
    # a CPU smoke run
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, lr=3e-3, warmup=20, steps=300,
                 eval_interval=100, eval_iters=4, diag_interval=50, ckpt_interval=100),
}
# --fix: off; on, the complete fix (the paper's shift and delta from the fp32 O); paper, the paper's rule alone
FIX = {"off": False, "on": True, "paper": "paper"}
SPIKE_NATS = 1.0   # collapse when the smoothed loss is this far above its minimum (see the docstring)
EMA_BETA = 0.95    # smoothing of the training loss for the spike test: an average over ~1/(1-0.95) = 20 steps
EXTRA_ROWS = 3     # log rows still recorded after a spike, to see where it goes
KEEP_CKPTS = 3
DIAG_ROWS = 16     # diagnostic batch rows: the probe holds fp32 (rows, heads, T, T) scores per layer
BASE_COLUMNS = ["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # every default is None, so that a flag the user gave can be told from one they did not
    p.add_argument("--preset", choices=PRESETS)
    p.add_argument("--fix", choices=list(FIX))
    p.add_argument("--attn", choices=ATTN_BACKENDS)
    p.add_argument("--precision", choices=["fa2", "paper"])
    p.add_argument("--delta-from-p", action=argparse.BooleanOptionalAction,
                   help="kernel/emulate: delta = rowsum(dP * P), not from the forward's O (the paper's control)")
    p.add_argument("--delta-fp32", action=argparse.BooleanOptionalAction,
                   help="kernel/emulate: delta from an fp32 copy of O, before its final bf16 cast (cures the default)")
    p.add_argument("--mantissa-bits", type=int, help="kernel/emulate: amplifier, P rounded to 1-6 mantissa bits before P V")
    p.add_argument("--amplify", choices=["p", "vo"],
                   help="what --mantissa-bits rounds: P (default) or V and O (amplifies the paper's tie bias)")
    p.add_argument("--stochastic-o", choices=["off", "forward", "delta"],
                   help="kernel/emulate: O stochastically rounded in the forward, or only where delta reads it")
    p.add_argument("--pos", choices=["learned", "none"],
                   help="position embeddings; none: layer 0 sees tokens only, so repeated tokens tie exactly")
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--minutes", type=float, help="wall-clock budget; stops at whichever of steps/minutes is first")
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup", type=int)
    p.add_argument("--schedule", choices=["constant", "cosine"])
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--dtype", choices=["bf16", "fp32"], help="bf16 autocast or plain fp32 (fp32 needs sdpa/fp32 attn)")
    p.add_argument("--out", help="folder of run folders (default runs/)")
    p.add_argument("--name", help="run folder name (default <preset>-<attn>-fix<fix>-s<seed>)")
    p.add_argument("--device", help="default cuda if available, else cpu")
    p.add_argument("--compile", choices=["off", "default", "reduce-overhead"],
                   help="torch.compile mode (default: reduce-overhead, i.e. CUDA graphs, on cuda; off on cpu)")
    p.add_argument("--log-interval", type=int)
    p.add_argument("--eval-interval", type=int)
    p.add_argument("--diag-interval", type=int)
    p.add_argument("--ckpt-interval", type=int)
    p.add_argument("--data", help="a UTF-8 text file (default $NANOLP_DATA, else TinyShakespeare)")
    p.add_argument("--resume", action="store_true", help="continue the run from its latest checkpoint")
    return p.parse_args(argv)


def resolve_config(args):
    """COMMON, then the preset, then the flags given; on --resume the run's own config.json replaces the preset
    (COMMON then only fills in options added after the run was started)."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    config = {**COMMON, **PRESETS[given.get("preset", "default")], "preset": "default", **given}
    config.setdefault("name", "{preset}-{attn}-fix{fix}-s{seed}".format(**config))
    if args.resume:
        saved = json.loads((Path(config["out"]) / config["name"] / "config.json").read_text())
        config = {**COMMON, **saved, **given}
    config.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    # CUDA graphs: a step of the default preset is half kernel-launch time without them (results/research.md)
    config.setdefault("compile", "reduce-overhead" if config["device"].startswith("cuda") else "off")
    return config


def get_lr(step, c):
    """Linear warmup, then constant (the paper's near-constant lr) or a cosine decay to 10% at the last step."""
    if step < c["warmup"]:
        return c["lr"] * (step + 1) / c["warmup"]
    if c["schedule"] == "constant":
        return c["lr"]
    progress = (step - c["warmup"]) / max(1, c["steps"] - c["warmup"])
    return c["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * min(progress, 1.0))))


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
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, f"{path}.tmp")
    os.replace(f"{path}.tmp", path)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-KEEP_CKPTS]:
        old.unlink()


def load_checkpoint(run_dir, model, optimizer, device, columns):
    """Restore the newest checkpoint and drop the log rows written after it (they will be written again)."""
    ckpts = sorted((run_dir / "ckpt").glob("step_*.pt"))
    if not ckpts:
        raise FileNotFoundError(f"--resume: no checkpoint in {run_dir / 'ckpt'}")
    ckpt = torch.load(ckpts[-1], map_location=device)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
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
    """summary.json, from log.csv (so a resumed run summarises all of itself) and the collapse, if any."""
    with open(run_dir / "log.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    column = lambda name: [float(r[name]) for r in rows if r[name] != ""]
    last = lambda name: column(name)[-1] if column(name) and math.isfinite(column(name)[-1]) else None
    max_logits = [x for i in range(c["n_layer"]) for x in column(f"max_logit_L{i}")]
    tokens_per_s = statistics.median(column("tokens_per_s")) if rows else 0.0  # the median skips compile time
    device = torch.device(c["device"])
    summary = dict(
        collapsed=collapse is not None,
        collapse_step=(collapse or {}).get("step"),
        collapse_minute=(collapse or {}).get("minute"),
        reason=(collapse or {}).get("reason"),
        steps=int(rows[-1]["step"]) if rows else 0,
        minutes=float(rows[-1]["elapsed_s"]) / 60 if rows else 0.0,
        final_val_loss=last("val_loss"),
        final_train_loss=last("train_loss"),  # None after a non-finite loss
        max_logit=max(max_logits) if max_logits else None,  # the largest seen over the whole run
        tokens_per_s=tokens_per_s,
        mfu=c["flops_per_token"] * tokens_per_s / H200_BF16_PEAK_FLOPS,
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        name=c["name"], fix=c["fix"], attn=c["attn"], precision=c["precision"], seed=c["seed"], preset=c["preset"],
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv=None):
    args = parse_args(argv)
    c = resolve_config(args)
    run_dir = Path(c["out"]) / c["name"]
    device = torch.device(c["device"])
    B, T = c["batch_size"], c["block_size"]

    data = prepare(c["data"])
    train_tokens, val_tokens = data.train.long().to(device), data.val.long().to(device)
    torch.manual_seed(c["seed"])  # the initial weights; the data order depends on (seed, step) only
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"],
                          n_embd=c["n_embd"], attn=c["attn"], fix=FIX[c["fix"]], precision=c["precision"],
                          delta_from_p=c["delta_from_p"], delta_fp32=c["delta_fp32"], mantissa_bits=c["mantissa_bits"],
                          amplify=c["amplify"], stochastic_o=c["stochastic_o"], pos=c["pos"])).to(device)
    c["vocab_size"], c["flops_per_token"] = data.vocab_size, model.flops_per_token()
    # weight decay, when asked for, on matrices only (not on biases and LayerNorm gains), as in GPT-2
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=device.type == "cuda")
    columns = BASE_COLUMNS + diag_columns(c["n_layer"], c["n_head"])

    # the loop's whole state: a checkpoint of it (with model and optimizer) continues the run exactly
    state = dict(step=0, elapsed=0.0, ema=None, loss_min=math.inf)
    if args.resume:
        state = load_checkpoint(run_dir, model, optimizer, device, columns)
        print(f"resuming {run_dir} at step {state['step']}")
    elif (run_dir / "log.csv").exists():
        raise FileExistsError(f"{run_dir} exists: pass --resume to continue it, or --name for a new run")
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_rows(run_dir / "log.csv", [], columns, "w")
    (run_dir / "config.json").write_text(json.dumps(c, indent=2) + "\n")
    print(f"{run_dir}: {sum(p.numel() for p in params) / 1e6:.2f}M parameters, attention {c['attn']}, "
          f"fix {c['fix']}, {c['flops_per_token'] / 1e6:.1f} MFLOPs/token, on {device}")
    if device.type == "cpu" and c["preset"] != "tiny":
        print("note: this preset is sized for a GPU; on a CPU one step can take many seconds "
              "(try --preset tiny, or --dtype fp32 --attn sdpa)")

    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bf16" else nullcontext()
    # diagnostics use the plain model (hooks)
    train_model = model if c["compile"] == "off" else torch.compile(model, mode=c["compile"])
    diag_x, diag_y = get_batch(val_tokens, min(B, DIAG_ROWS), T, seed=0, step=0)
    probe = [get_batch(val_tokens, B, T, seed=1, step=i) for i in range(PROBE_BATCHES)]   # delta_probe's rows
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
