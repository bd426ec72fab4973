"""Run a grid of train.py runs side by side (one GPU, a wall-clock budget) and collect their summaries into a CSV.

    python -m nanolp.sweep --arm off="--fix off" --arm on="--fix on" --seeds 0 1 2 3 --minutes 20
    python -m nanolp.sweep --arm b3="--mantissa-bits 3 --fix off" --seeds 0 1 --steps 20000 --minutes 10 --parallel 4
    python -m nanolp.sweep --collect runs/sweep /tmp/gpu2/runs --csv results/search.csv

A run is one (arm, seed): train.py with the arm's flags, --seed SEED, --name ARM-sSEED, --out OUT. Each time the
sweep is invoked it looks at every run's folder under --out:
    finished  summary.json says it collapsed, or that it reached its step target      -> skipped
    resumable a checkpoint in ckpt/                                                   -> train.py --resume
    stale     a log.csv but no checkpoint (stopped before its first one)              -> moved to OUT/.stale/, restarted
    new       no log.csv yet                                                          -> started
so the same command, invoked again, carries an unfinished sweep on. Runs wait in a queue for one of --parallel slots.

Time: --minutes M is this invocation's wall-clock budget. train.py's --minutes counts only its training loop and
is cumulative over resumes (it is saved in the checkpoint), so a run started with R minutes left gets
--minutes (training minutes it already has) + R - --margin; the margin covers start-up and the final evaluation.
A run that is still alive at the deadline (plus --grace seconds) is terminated; its checkpoints survive, and the
next invocation resumes it. A run is not started with less than --min-minutes left. Without --minutes there is
no budget and runs go to their step target.

At the end (and on --collect) every run folder becomes one row of a CSV (COLUMNS), by default OUT/summary.csv.
"""

import argparse
import csv
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from nanolp.runs import find_runs, load_run, read_json

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "train.py"
OWNED_FLAGS = ("--name", "--out", "--seed", "--minutes", "--resume")  # the sweep sets these; an arm may not
# first_growth_*: the first head whose W_Q spectral norm exceeds GROWTH x its value at a quarter of the run
# (early training triples every norm from its initial value, so the first rows are no baseline)
GROWTH = 3.0

COLUMNS = ["name", "arm", "seed", "attn", "precision", "fix", "delta_from_p", "delta_fp32", "mantissa_bits", "amplify",
           "lr", "batch_size", "block_size", "n_layer", "n_embd", "steps", "minutes", "collapsed", "collapse_step",
           "collapse_minute", "reason", "max_logit", "tie_rate_final", "tie_rate_head_peak", "final_val_loss",
           "final_train_loss", "tokens_per_s", "peak_mem_gb", "first_growth_layer", "first_growth_head",
           "first_growth_step"]


# -----------------------------------------------------------------------------
# Planning: what each run needs


def flag_value(flags, name):
    """The value of the last `--name X` or `--name=X` in a list of flags, else None."""
    value = None
    for i, flag in enumerate(flags):
        if flag == name and i + 1 < len(flags):
            value = flags[i + 1]
        elif flag.startswith(name + "="):
            value = flag.split("=", 1)[1]
    return value


def run_state(run_dir, target_steps=None):
    """'finished', 'resumable', 'stale' or 'new' (see the top of this file). target_steps is the run's step
    target (None: the one in its config.json)."""
    if not (run_dir / "log.csv").exists():
        return "new"  # (a folder with only stdout.log: train.py failed before it started; start again)
    summary, config = read_json(run_dir / "summary.json"), read_json(run_dir / "config.json")
    target = target_steps if target_steps is not None else config.get("steps")
    if summary and (summary.get("collapsed") or (target is not None and summary.get("steps", 0) >= target)):
        return "finished"
    if latest_checkpoint(run_dir) is not None:
        return "resumable"
    return "stale"


def latest_checkpoint(run_dir):
    ckpts = sorted((run_dir / "ckpt").glob("step_*.pt"))
    return ckpts[-1] if ckpts else None


def trained_minutes(run_dir):
    """Training minutes a resume starts from: the elapsed_s that log.csv recorded at the latest checkpoint's step
    (train.py saves exactly that elapsed time in the checkpoint)."""
    step = int(latest_checkpoint(run_dir).stem.split("_")[1])
    log = load_run(run_dir).log
    at = np.flatnonzero(log.get("step", np.array([])) == step)
    return float(log["elapsed_s"][at[-1]]) / 60 if len(at) else 0.0


def train_command(run, flags, minutes_left, margin):
    """train.py's argv for one run: the sweep-wide flags, the arm's (which win), then the ones the sweep owns."""
    cmd = [sys.executable, str(TRAIN), *flags, "--out", str(run["dir"].parent), "--name", run["dir"].name,
           "--seed", str(run["seed"])]
    if run["state"] == "resumable":
        cmd.append("--resume")
    if minutes_left is not None:
        already = trained_minutes(run["dir"]) if run["state"] == "resumable" else 0.0
        cmd += ["--minutes", f"{already + minutes_left - margin:.3f}"]
    return cmd


def warm_data_cache(flag_lists):
    """Tokenize each distinct text once here, so that parallel runs find the token cache instead of all
    writing it at the same time."""
    from nanolp.data import prepare  # imports torch: only when a sweep actually runs
    for path in sorted({flag_value(flags, "--data") or "" for flags in flag_lists}):
        prepare(path or None)


# -----------------------------------------------------------------------------
# Running


def sweep(arms, seeds, out, common=(), minutes=None, parallel=None, margin=0.5, min_minutes=1.0, grace=30.0,
          poll=1.0):
    """Start/resume every unfinished (arm, seed) run of `arms` ({name: [flags]}) under `out`, at most `parallel`
    at a time, within `minutes`. Returns {run name: state or train.py's return code}."""
    out = Path(out)
    deadline = None if minutes is None else time.time() + 60 * minutes
    runs, results = [], {}
    for arm, arm_flags in arms.items():
        flags = [*common, *arm_flags]
        steps = flag_value(flags, "--steps")
        for seed in seeds:
            run = dict(name=f"{arm}-s{seed}", dir=out / f"{arm}-s{seed}", seed=seed, flags=flags,
                       target=None if steps is None else int(steps))
            run["state"] = run_state(run["dir"], run["target"])
            print(f"{run['name']}: {run['state']}")
            if run["state"] == "finished":
                results[run["name"]] = "finished"
            else:
                runs.append(run)
    if runs:
        warm_data_cache([run["flags"] for run in runs])
    parallel = parallel or max(1, len(runs))
    queue, active, terminated = list(runs), [], set()  # active: (run, Popen, log file)
    try:
        while queue or active:
            left = None if deadline is None else (deadline - time.time()) / 60
            while queue and len(active) < parallel and (left is None or min(left, left - margin) >= min_minutes):
                run = queue.pop(0)
                if run["state"] == "stale":
                    stale = out / ".stale" / f"{run['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
                    stale.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(run["dir"], stale)
                    print(f"{run['name']}: no checkpoint to resume from; moved to {stale}, starting again")
                    run["state"] = "new"
                cmd = train_command(run, run["flags"], left, margin)
                run["dir"].mkdir(parents=True, exist_ok=True)
                log = open(run["dir"] / "stdout.log", "a")
                log.write(f"$ {shlex.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
                print(f"{run['name']}: {'resumed' if '--resume' in cmd else 'started'} (pid {proc.pid})")
                active.append((run, proc, log))
            if not active:
                break  # nothing running and too little time left to start anything
            time.sleep(poll)
            late = 0.0 if deadline is None else time.time() - deadline - grace
            for run, proc, _ in active:
                if late > 0 and proc.poll() is None and run["name"] not in terminated:
                    print(f"{run['name']}: past the deadline, terminating (pid {proc.pid})")
                    proc.terminate()
                    terminated.add(run["name"])
                elif late > grace and proc.poll() is None:
                    proc.kill()
            for item in list(active):
                run, proc, log = item
                if proc.poll() is not None:
                    log.close()
                    active.remove(item)
                    state = run_state(run["dir"], run["target"])
                    results[run["name"]] = "terminated" if run["name"] in terminated else proc.returncode
                    print(f"{run['name']}: exited {proc.returncode}, now {state}")
    finally:
        for run, proc, log in active:  # interrupted: leave no orphans behind
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
    for run in queue:
        results[run["name"]] = "not started"
        print(f"{run['name']}: not started (too little time left)")
    return results


# -----------------------------------------------------------------------------
# Collecting


def last_finite(values):
    values = values[np.isfinite(values)]
    return float(values[-1]) if len(values) else None


def first_growth(log):
    """(layer, head, step) of the first head whose sn_q_L{i}_H{h} exceeds GROWTH x its value at the first
    diagnostic row past a quarter of the run (ties at one step: the largest ratio), or Nones."""
    best = None  # (step, -ratio, layer, head)
    for column in log:
        match = re.fullmatch(r"sn_q_L(\d+)_H(\d+)", column)
        if not match:
            continue
        keep = np.isfinite(log[column]) & np.isfinite(log["step"])
        keep &= log["step"] >= np.nanmax(log["step"]) / 4
        values, steps = log[column][keep], log["step"][keep]
        if not len(values) or values[0] <= 0:
            continue
        grown = np.flatnonzero(values > GROWTH * values[0])
        if len(grown):
            i = grown[0]
            candidate = (steps[i], -values[i] / values[0], int(match[1]), int(match[2]))
            best = candidate if best is None else min(best, candidate)
    return (None, None, None) if best is None else (best[2], best[3], int(best[0]))


def collect_row(path):
    run = load_run(path)
    log = run.log
    last_elapsed = last_finite(log["elapsed_s"]) if "elapsed_s" in log else None
    tie_rates = [last_finite(log[c]) for c in run.columns(r"tie_rate_L\d+")]
    tie_rates = [t for t in tie_rates if t is not None]
    head_peaks = [np.nanmax(log[c]) for c in run.columns(r"tie_rate_L\d+_H\d+") if np.isfinite(log[c]).any()]
    layer, head, growth_step = first_growth(log)
    s = run.summary
    return dict(
        name=run.name, arm=run.arm, seed=run.setting("seed"),
        **{key: run.setting(key) for key in ("attn", "precision", "fix")},
        delta_from_p=run.setting("delta_from_p", False), delta_fp32=run.setting("delta_fp32", False),
        mantissa_bits=run.setting("mantissa_bits", 0),
        amplify=run.setting("amplify", "p"),
        **{key: run.setting(key) for key in ("lr", "batch_size", "block_size", "n_layer", "n_embd")},
        # a run without summary.json (in progress, or killed) still has its log
        steps=run.steps,
        minutes=s.get("minutes", None if last_elapsed is None else last_elapsed / 60),
        **{key: s.get(key) for key in ("collapsed", "collapse_step", "collapse_minute", "reason")},
        max_logit=run.max_logit,
        tie_rate_final=max(tie_rates) if tie_rates else None,
        tie_rate_head_peak=max(head_peaks) if head_peaks else None,    # the paper's failure starts in a few heads
        final_val_loss=run.final_val_loss,
        final_train_loss=s.get("final_train_loss", last_finite(log["train_loss"]) if "train_loss" in log else None),
        tokens_per_s=run.tokens_per_s, peak_mem_gb=s.get("peak_mem_gb"),
        first_growth_layer=layer, first_growth_head=head, first_growth_step=growth_step,
    )


def cell(value):
    """CSV text: empty for None/NaN, floats to 6 significant digits."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, float):
        return repr(float(f"{value:.6g}"))
    return value


def write_csv(path, rows, columns):
    """Rows (dicts) as a CSV of these columns, each value written by cell()."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in row.items()} for row in rows)


def collect(paths, csv_path):
    """One row per run folder found in `paths` (run folders or folders of them), written to csv_path."""
    rows = [collect_row(path) for path in find_runs(paths)]
    write_csv(csv_path, rows, COLUMNS)
    return rows


# -----------------------------------------------------------------------------


def parse_arm(text):
    name, sep, flags = text.partition("=")
    if not sep or not re.fullmatch(r"[\w.+-]+", name):
        raise argparse.ArgumentTypeError(f"--arm wants NAME=\"train.py flags\", got {text!r}")
    flags = shlex.split(flags)
    for flag in flags:
        if flag.split("=")[0] in OWNED_FLAGS:
            raise argparse.ArgumentTypeError(f"arm {name}: {flag} is set by the sweep ({', '.join(OWNED_FLAGS)})")
    return name, flags


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arm", type=parse_arm, action="append", default=[], metavar='NAME="FLAGS"',
                   help="an arm: a name and train.py flags (repeatable)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--minutes", type=float, help="wall-clock budget of this invocation (default: none)")
    p.add_argument("--parallel", type=int, help="train.py processes at once (default: all)")
    p.add_argument("--out", default="runs/sweep", help="folder of the run folders")
    p.add_argument("--steps", type=int, help="train.py --steps for every arm (an arm's own --steps wins)")
    p.add_argument("--data", help="train.py --data for every arm")
    p.add_argument("--margin", type=float, default=0.5, help="minutes kept back for start-up and the final eval")
    p.add_argument("--min-minutes", type=float, default=1.0, help="don't start a run with less training time")
    p.add_argument("--grace", type=float, default=30.0, help="seconds past the deadline before terminating")
    p.add_argument("--collect", nargs="+", metavar="DIR", help="only collect these run folders (or folders of them)")
    p.add_argument("--csv", help="where the CSV goes (default OUT/summary.csv)")
    args = p.parse_args(argv)

    if args.collect:
        rows = collect(args.collect, args.csv or Path(args.out) / "summary.csv")
        print(f"{len(rows)} runs -> {args.csv or Path(args.out) / 'summary.csv'}")
        return 0
    if not args.arm:
        p.error("give at least one --arm, or --collect")
    arms = dict(args.arm)
    if len(arms) != len(args.arm):
        p.error("two arms have the same name")
    common = ([] if args.steps is None else ["--steps", str(args.steps)]) + \
             ([] if args.data is None else ["--data", args.data])
    results = sweep(arms, args.seeds, args.out, common, args.minutes, args.parallel, args.margin,
                    args.min_minutes, args.grace)
    csv_path = args.csv or Path(args.out) / "summary.csv"
    rows = collect([args.out], csv_path)
    print(f"{len(rows)} runs -> {csv_path}")
    failed = {name: rc for name, rc in results.items() if isinstance(rc, int) and rc != 0}
    if failed:
        print(f"failed (see <run>/stdout.log): {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
