"""
Train a small character-level GPT in bf16 and watch for the low-precision attention failure of Qiu & Yao (2025): in
flash attention, delta = rowsum(dO * O) carries a one-signed rounding error that grows the attention logits until
the loss blows up (a collapse: a non-finite loss, or a loss spike, SPIKE_NATS below; summary.json says when).

    python train.py --fix off      # plain bf16: collapses (on every seed run: README.md's table)
    python train.py --fix on       # the fix, delta read from the forward's fp32 O: trains through (README.md's table)
    python train.py --fix paper    # the paper's rule (a tied row max shifted up): collapses (README.md's table)
    python train.py --preset tiny --fix on      # a CPU smoke run, through the kernel's emulation: no collapse
    python train.py --fix off --resume          # continue runs/default-kernel-fixoff-s0 from its latest checkpoint

DEFAULT below holds the settings (--device's and --compile's follow the machine: nanolp/runconfig.py). The
experiments (--help) change the attention's numerics or the block. Below the settings, the training (train): the
data, the model, the optimizer, then the loop, which detects a collapse, logs the diagnostics and writes the
checkpoints; then the command line (main). A run writes runs/<name>/ (its files, and which folders a command may
write or resume: nanolp/runs.py; its flags, settings and name: nanolp/runconfig.py). A command that cannot run is
refused before it writes a run folder (exit status 2); so is a preset sized for a GPU on a machine without one,
unless --device cpu insists. Ctrl-C stops a run with one line (exit status 130): its last checkpoint and the command
that continues from it; before the first checkpoint, that there is nothing to resume; after a collapse, that the run
has ended (its summary written).
"""

import math
import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from tqdm import tqdm

from model import ATTN_BACKENDS, GPT, POSITIONS, GPTConfig, implementation
from nanolp import data, runconfig, runs
from nanolp.diagnostics import LOGIT, PROBE_BATCHES, PROBE_LAYER, diag_columns, diagnose
from nanolp.runconfig import GPT2_BLOCK, PLAIN_NUMERICS

# -----------------------------------------------------------------------------
# The settings: the default preset, the demo. Plain bf16 on TinyShakespeare, the paper's setting at a size where
# the failure comes within minutes on one GPU (how it was chosen: results/default_search/). The model memorises
# the text (train loss ~0.05) and then trains on near-zero gradients; there the one-signed error that O's final
# bf16 cast puts into delta grows layer 0's W_Q and logits until the loss blows up. How often and how soon, per
# arm and seed: README.md's table (every arm: results/README.md's). A setting's flag is its name (n_layer:
# --n-layer), but for beta1, beta2, weight_decay, grad_clip and eval_iters, fixed here; --help shows a preset's values.
DEFAULT = dict(
    # the model: GPT-2's block (learned positions, no QK-norm: nanolp.runconfig.GPT2_BLOCK)
    n_layer=6, n_head=6, n_embd=384, block_size=256, **GPT2_BLOCK,
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
    # the default run on a text ~100x TinyShakespeare, which it cannot learn by heart in a run: a collapse without
    # memorisation (docs/findings.md, section 10; the text: data/README.md, built by `python -m experiments.corpus`)
    "corpus": DEFAULT | dict(data="data/corpus/input.txt"),
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
#     The run goes on EXTRA_ROWS log intervals more, each row with diagnostics, then stops.
SPIKE_NATS = 1.0   # collapse when the smoothed loss is this far above its minimum
EMA_BETA = 0.95    # smoothing of the training loss for the spike test: an average over ~1/(1-0.95) = 20 steps
EXTRA_ROWS = 3     # log intervals still run after a spike, to see where it goes
ROW_INTERVALS = ("log_interval", "eval_interval", "diag_interval", "ckpt_interval")   # a log row at each of these
DIAG_ROWS = 16     # diagnostic batch rows: the diagnostics hold fp32 (rows, heads, T, T) scores per layer
BASE_COLUMNS = ["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]
# the model's options that the flags --attn and --pos choose from (model.py's; nanolp never imports model.py)
CHOICES = dict(attn=ATTN_BACKENDS, pos=POSITIONS)


def train(c, corpus, resume):
    """Train the run that settings c describe (nanolp.runconfig.resolve_config) on the text's tokens (corpus:
    nanolp.data.prepare) in its folder, claimed (nanolp.runs.claim_folder), from scratch or, on resume, from its
    latest checkpoint; until c["steps"], c["minutes"] or a collapse. A row of log.csv every log interval (and at
    every evaluation, diagnostics and checkpoint interval), a checkpoint every checkpoint interval and at the end.
    Returns the run's summary; Ctrl-C raises nanolp.runs.Stopped."""
    run_dir, device = Path(c["out"]) / c["name"], torch.device(c["device"])
    B, T = c["batch_size"], c["block_size"]

    # the data: the text's tokens on the device. The diagnostics' batches: one of the validation text, and the
    # probe's rows (nanolp.diagnostics.delta_probe), fixed batches of the training text, where the memorised model's
    # gradient is tiny (the regime the curvature effect is about: docs/findings.md, section 4), drawn with a seed no
    # run may take.
    train_tokens, val_tokens = corpus.train.long().to(device), corpus.val.long().to(device)
    diag_x, diag_y = data.get_batch(val_tokens, min(B, DIAG_ROWS), T, seed=0, step=0)
    probe = [data.get_batch(train_tokens, B, T, seed=data.PROBE_SEED, step=i) for i in range(PROBE_BATCHES)]

    # the model
    torch.manual_seed(c["seed"])  # the initial weights; the data order depends on (seed, step) only
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=T, n_layer=c["n_layer"], n_head=c["n_head"],
                          n_embd=c["n_embd"], attn=c["attn"], fix=c["fix"], numerics=runconfig.numerics(c),
                          pos=c["pos"], qk_norm=c["qk_norm"])).to(device)
    c["vocab_size"], c["flops_per_token"] = corpus.vocab_size, model.flops_per_token()

    # the optimizer: weight decay (none by default) on matrices only, not on biases and LayerNorm gains, as in GPT-2
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": c["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=c["lr"], betas=(c["beta1"], c["beta2"]), fused=device.type == "cuda")

    # the loop's whole state: a checkpoint of it (with model and optimizer) continues the run exactly. On resume the
    # state, the model and the optimizer come from the newest good checkpoint, and log.csv is cut back to its step.
    columns = BASE_COLUMNS + diag_columns(c["n_layer"], c["n_head"], c["qk_norm"])
    state = dict(step=0, elapsed=0.0, ema=None, loss_min=math.inf)   # ema, loss_min: the spike test's (loss_spike)
    if resume:
        state = runs.resume(run_dir, c, model, optimizer, columns)
    else:   # (claim_folder made sure that the folder holds no run)
        runs.write_rows(run_dir / "log.csv", [], columns, "w")
    c.setdefault("provenance", runs.provenance(device))   # (kept from the run's start on --resume)
    c["attn_impl"] = implementation(c["attn"], device.type)   # what computes attn here: on a CPU, kernel's emulation
    runs.write_json(run_dir / "config.json", c)
    print(f"{run_dir}: {runconfig.describe(c, PRESETS)}; {sum(p.numel() for p in params) / 1e6:.2f}M parameters, "
          f"{c['flops_per_token'] / 1e6:.1f} MFLOPs/token, on {device}")

    # the loop: in bf16 the model runs under autocast; train_model may be compiled, the diagnostics get the model
    # itself (their forward hooks run eagerly)
    ctx = torch.autocast(device.type, dtype=torch.bfloat16) if c["dtype"] == "bf16" else nullcontext()
    train_model = model if c["compile"] == "off" else torch.compile(model, mode=c["compile"])
    # stop_at: --steps, brought in by --minutes, a loss spike (EXTRA_ROWS log intervals on) or a non-finite loss
    step, collapse, stop_at = state["step"], None, c["steps"]
    if c["minutes"] is not None and state["elapsed"] >= 60 * c["minutes"]:   # (resumed after its last checkpoint and
        stop_at = step                                                       # before its summary: no step to train)
    loss_sum, grad_sum, n_acc = torch.zeros((), device=device), torch.zeros((), device=device), 0
    bad_step = torch.full((), -1, device=device)  # first step (counted as the log counts) with a non-finite loss
    t_start = t_row = time.time()
    elapsed0 = state["elapsed"]
    pbar = tqdm(total=c["steps"], initial=step, dynamic_ncols=True)
    logit = None   # LOGIT at the last diagnostics, for the progress bar
    summary = None
    row = None   # a log row found, not yet written (a collapse's, should Ctrl-C come during its diagnostics)
    try:
        while step < stop_at:
            # the step: its batch (a pure function of seed and step), forward, backward, clip, update
            lr = get_lr(step, c)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = data.get_batch(train_tokens, B, T, c["seed"], step)
            torch.compiler.cudagraph_mark_step_begin()  # CUDA graphs may now reuse the last step's output buffers
            with ctx:
                _, loss = train_model(x, y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

            # bookkeeping, on the device: no host sync until the next log row
            loss = loss.detach()
            bad_step = torch.where(torch.isfinite(loss) | (bad_step >= 0), bad_step, step + 1)   # (no host sync)
            state["ema"] = loss.clone() if state["ema"] is None else state["ema"].lerp(loss, 1 - EMA_BETA)
            loss_sum += loss
            grad_sum += grad_norm
            n_acc += 1
            step += 1
            pbar.update()
            elapsed = elapsed0 + time.time() - t_start
            if c["minutes"] is not None and elapsed >= 60 * c["minutes"]:
                stop_at = step
            if not (step >= stop_at or any(step % c[k] == 0 for k in ROW_INTERVALS)):
                continue

            # a log row: the losses, the collapse test, an evaluation and diagnostics when due
            train_loss = (loss_sum / n_acc).item()  # the row's first host sync (the steps between have none)
            tokens_per_s = n_acc * B * T / (time.time() - t_row)
            row = dict(step=step, elapsed_s=round(elapsed, 2), tokens=step * B * T, lr=lr, train_loss=train_loss,
                       grad_norm=(grad_sum / n_acc).item(), tokens_per_s=round(tokens_per_s, 1),
                       mfu=runs.mfu(c, tokens_per_s))
            bad = bad_step.item()
            reason = f"non-finite loss at step {bad}" if bad >= 0 else loss_spike(state, step, c)
            if reason and collapse is None:
                collapse = dict(step=bad if bad >= 0 else step, minute=elapsed / 60, reason=reason)
                stop_at = min(stop_at, step + EXTRA_ROWS * c["log_interval"])
                tqdm.write(f"collapse at step {collapse['step']}: {reason}")
            # the weights are poisoned by a non-finite loss, and by a non-finite gradient whose loss was finite (the
            # backward can overflow where the forward did not): clipping makes them NaN. A norm that overflowed
            # over finite gradients clips them to 0 and leaves the weights finite, so they are looked at.
            # Poisoned: no eval, no diagnostics, no checkpoint
            poisoned = bad >= 0 or (not math.isfinite(row["grad_norm"])
                                    and not all(torch.isfinite(p).all() for p in params))
            if bad >= 0:
                stop_at = step
            elif poisoned:   # (the next step's loss is non-finite: a collapse, which stops the run)
                tqdm.write(f"step {step}: a non-finite gradient norm, its loss finite: the weights are not finite; no "
                           f"evaluation, diagnostics or checkpoint")
                if collapse is None and step >= stop_at:   # the last row: no next step will show it, so say it here
                    collapse = dict(step=step, minute=elapsed / 60,
                                    reason=f"non-finite gradient norm by step {step}, its loss finite")
            else:   # (an arm that rounds O stochastically draws from torch's generator: forked here, the evaluation
                    # and diagnostics take nothing from the training's stream, the same whatever their intervals)
                cuda = [device] if device.type == "cuda" else []
                with torch.random.fork_rng(devices=cuda, enabled=model.config.numerics.draws):
                    if step % c["eval_interval"] == 0 or step >= stop_at:
                        row["val_loss"] = evaluate(train_model, val_tokens, c, ctx)
                    if step % c["diag_interval"] == 0 or step >= stop_at or collapse:  # every row once collapsed
                        row.update(diagnose(model, diag_x, diag_y, ctx, probe, seed=step))  # a fresh probe draw
                        logit = row[LOGIT]
            runs.write_rows(run_dir / "log.csv", [row], columns)
            row = None
            if collapse is not None:   # recorded with its row: a kill during the rows after it cannot lose it
                runs.write_summary(run_dir, c, collapse)
            pbar.set_postfix({"loss": f"{train_loss:.4f}", LOGIT: "-" if logit is None else f"{logit:.4g}"})

            # a checkpoint: only finite, pre-collapse state is saved; also at the end, so that --resume continues
            if collapse is None and not poisoned and (step % c["ckpt_interval"] == 0 or step >= stop_at):
                state.update(step=step, elapsed=elapsed0 + time.time() - t_start)   # (this row's eval counted)
                runs.save_checkpoint(run_dir, model, optimizer, state)
            loss_sum.zero_(), grad_sum.zero_()   # the next row's sums and clock, from here: its tokens/s counts
                                                 # the training steps, not this row's eval, diagnostics, checkpoint
            n_acc, t_row = 0, time.time()
        pbar.close()
        summary = runs.write_summary(run_dir, c, collapse)
        print_outcome(run_dir, c, summary)
    except KeyboardInterrupt:   # Ctrl-C: what the run wrote is whole (a log row, a checkpoint: save_checkpoint;
        pbar.close()            # summary.json: write_json). A collapse found is the run's result: its row and its
        if summary is None and collapse is not None:   # summary are written now (the rows after it cut short)
            if row is not None:
                runs.write_rows(run_dir / "log.csv", [row], columns)
            summary = runs.write_summary(run_dir, c, collapse)
        raise runs.Stopped(run_dir, c, step, summary) from None
    return summary


def get_lr(step, c):
    """Linear warmup, then constant, as the paper trains (a near-constant lr)."""
    return c["lr"] * (step + 1) / c["warmup"] if step < c["warmup"] else c["lr"]


def loss_spike(state, step, c):
    """The loss-spike half of the collapse criterion (above SPIKE_NATS): None, or why it fired. Updates
    state["loss_min"], the smoothed loss's minimum after the warmup, at the rows of ROW_INTERVALS: not at a run's
    last row off them (--steps 157), which a run resumed from it would count and an uninterrupted one not."""
    smoothed = state["ema"].item()
    if step > c["warmup"] and any(step % c[k] == 0 for k in ROW_INTERVALS):
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
        x, y = data.get_batch(tokens, c["batch_size"], c["block_size"], seed=0, step=i)
        with ctx:
            total += model(x, y)[1]
    return (total / c["eval_iters"]).item()


def print_outcome(run_dir, c, summary):
    """The run's end in a few plain lines; summary.json holds the whole outcome and arm."""
    print(runs.outcome(summary))
    if c["preset"] == "tiny" and not summary["collapsed"]:
        print(TINY_NOTE)
    logits = [v for v in runs.read_log(run_dir / "log.csv").get(LOGIT, []) if math.isfinite(v)]
    if logits:
        print(f"layer {PROBE_LAYER}'s max attention logit peaked at {max(logits):.4g}")
    print(f"run folder: {run_dir} (summary.json: the outcome and the arm; config.json: every setting)")
    analyze = os.path.relpath(Path(__file__).with_name("analyze.py"))   # (analyze.py from where this ran)
    print(f"next: python {analyze} {c['out']}   (figures and report.md of the runs in {c['out']}, written to "
          f"{Path(c['out']) / 'figures'})")


def main(argv=None):
    """The command line: train.py's flags (nanolp.runconfig.parser), then the run. A command that cannot run as given
    (a setting, the text, the run folder) is refused before it writes a run folder, as argparse refuses a
    malformed flag: one line per problem on stderr, exit status 2 (nanolp.runs.refusals)."""
    args = runconfig.parse_args(argv, PRESETS, CHOICES)
    with runs.refusals():
        c = runconfig.resolve_config(args, PRESETS)   # the preset, the flags, and on --resume the run's config.json
        runconfig.check_machine(c, args, PRESETS)
        run_dir = Path(c["out"]) / c["name"]
        text = data.find_text(c["data"])
        corpus = data.prepare(text, block_size=c["block_size"])
        if c.setdefault("data_sha1", corpus.sha1) != corpus.sha1:   # (only a resumed run has one already)
            raise runconfig.RunError(f"--resume {run_dir}: the text {text} has changed since the run started "
                                     f"(sha1 {c['data_sha1'][:12]}, now {corpus.sha1[:12]})")
        with runs.locked(run_dir):   # no other run writes the folder while this one does
            runs.claim_folder(run_dir, c, args.resume, PRESETS)
            return train(c, corpus, args.resume)


if __name__ == "__main__":
    main()
