"""The late stage: once layer 0's logits have run away, what takes the loss down? One `--fix off` run is trained
until layer 0's max logit passes --fork-at, then its checkpoint there is continued side by side, once per arm:

    fma         the kernel as it ships: softmax's exponent one fused multiply-add, as FlashAttention-2 ships it
    torch       --exponent torch: S * scale rounded before the max is subtracted, as PyTorch builds FA2
    sdpa-flash  --attn sdpa-flash: torch's own flash backend (PyTorch's FA2)

    python -m experiments.late_stage --seed 3                     # on a GPU (its time: experiments/README.md)
    python -m experiments.late_stage --collect runs/late_stage    # -> results/late_stage/: thinned logs, runs.csv

The arms start from the same weights, optimizer state and random streams and see the same batches, so whatever
differs after the fork comes from the attention alone. Each arm is a run folder of its own, made from the base
run's: its config.json with the arm's setting and "forked_from", its log up to the fork, the fork's checkpoint;
train.py --resume continues it like any run.
"""
import argparse
import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from experiments.sweep import COLUMNS, collect_row
from nanolp.runconfig import read_json
from nanolp.runs import checksum_path, load_run, read_log, thin_log, write_csv

ROOT = Path(__file__).resolve().parent.parent
ARMS = {"fma": {}, "torch": {"exponent": "torch"}, "sdpa-flash": {"attn": "sdpa-flash"}}


def train(*flags):
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags], cwd=ROOT)


def fork_step(base, fork_at):
    """The first diagnostic row's step with layer 0's max logit >= fork_at whose checkpoint is written, or None."""
    if not (base / "log.csv").exists():
        return None
    log = read_log(base / "log.csv")
    for step, logit in zip(log.get("step", []), log.get("max_logit_L0", [])):
        if logit >= fork_at and (base / "ckpt" / f"step_{int(step):07d}.pt").exists():
            return int(step)
    return None


def fork(base, step, arm, settings):
    """A run folder for one arm, continuing the base run's checkpoint at `step`."""
    run_dir = base.parent / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    (run_dir / "ckpt").mkdir(parents=True)
    config = {**read_json(base / "config.json"), **settings, "name": arm, "forked_from": f"{base.name}@{step}"}
    (run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    with open(base / "log.csv", newline="") as src, open(run_dir / "log.csv", "w", newline="") as dst:
        reader = csv.DictReader(src)
        writer = csv.DictWriter(dst, fieldnames=reader.fieldnames)
        writer.writeheader()
        writer.writerows(row for row in reader if int(row["step"]) <= step)
    ckpt = base / "ckpt" / f"step_{step:07d}.pt"
    for path in (ckpt, checksum_path(ckpt)):   # the checkpoint and its sha256, which --resume checks
        shutil.copy2(path, run_dir / "ckpt" / path.name)


def run(args):
    out = Path(args.out)
    base = out / "base"
    if base.exists():
        sys.exit(f"late_stage: {base} exists; pass another --out")
    every = str(args.every)   # diagnostics and checkpoints together: every diagnostic row can be a fork
    trainer = train("--preset", args.preset, "--fix", "off", "--seed", str(args.seed), "--out", str(out),
                    "--name", base.name, "--ckpt-interval", every, "--diag-interval", every, "--eval-interval", every,
                    "--steps", str(args.max_base_steps))
    step = None
    while step is None and trainer.poll() is None:
        time.sleep(2)
        step = fork_step(base, args.fork_at)
    trainer.terminate()   # its checkpoint at the fork is all the arms need
    trainer.wait()
    step = step or fork_step(base, args.fork_at)
    if step is None:
        sys.exit(f"late_stage: layer 0 never reached {args.fork_at:g} in {args.max_base_steps} steps (or the base "
                 f"run failed): nothing to fork")
    print(f"late_stage: layer 0 passed {args.fork_at:g} at step {step}; forking {', '.join(ARMS)}", flush=True)
    arms = []
    for arm, settings in ARMS.items():
        fork(base, step, arm, settings)
        arms.append(train("--resume", "--out", str(out), "--name", arm, "--steps", str(step + args.steps)))
    for trainer in arms:
        trainer.wait()


def collect(out, results):
    """The arms' folders under results/runs/ (config.json, summary.json, log thinned), and results/runs.csv."""
    missing = [str(Path(out) / arm) for arm in ARMS if not (Path(out) / arm / "summary.json").exists()]
    if missing:
        sys.exit(f"late_stage: no finished arm at {', '.join(missing)} (each arm's summary.json): nothing collected")
    rows = []
    for arm in ARMS:
        src, dst = Path(out) / arm, Path(results) / "runs" / arm
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        for name in ("config.json", "summary.json"):
            shutil.copy2(src / name, dst / name)
        thin_log(src / "log.csv", dst / "log.csv.gz")
        rows.append({**collect_row(load_run(dst), arm), "forked_from": read_json(dst / "config.json")["forked_from"]})
    write_csv(Path(results) / "runs.csv", rows, COLUMNS + ["forked_from"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=3, help="the base run's seed (default 3)")
    p.add_argument("--fork-at", type=float, default=1e5, help="layer 0's max logit to fork at (default 1e5)")
    p.add_argument("--steps", type=int, default=30_000, help="steps each arm trains after the fork (default 30000)")
    p.add_argument("--preset", default="default", help="train.py's preset (default default; tiny: a CPU check)")
    p.add_argument("--every", type=int, default=1000, help="steps between the base run's diagnostics and checkpoints")
    p.add_argument("--max-base-steps", type=int, default=150_000, help="give up forking after this many steps")
    p.add_argument("--out", default="runs/late_stage", help="where the run folders go (default runs/late_stage)")
    p.add_argument("--collect", metavar="OUT", help="collect OUT's arms into --results instead of training")
    p.add_argument("--results", default=str(ROOT / "results" / "late_stage"))
    args = p.parse_args(argv)
    if args.collect:
        collect(args.collect, args.results)
    else:
        run(args)


if __name__ == "__main__":
    main()
