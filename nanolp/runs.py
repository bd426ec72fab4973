"""Where a run is: its folder and the files in it, as train.py writes them and as every reader reads them back.

What train.py keeps there (and when it may write there: claim_folder, locked), and every reader's view of it, one
run's (load_run) or a study's table (runs.csv: study_runs). What a run is, its settings, checked and named, and their
JSON files read in today's spellings: nanolp/runconfig.py.

A run folder runs/<name>/ holds config.json (every resolved setting), log.csv (one row per log interval, with the
diagnostics of nanolp/diagnostics.py every --diag-interval steps), summary.json (the outcome and the whole arm:
every setting of ARM) and ckpt/ (the last KEEP_CKPTS checkpoints, each with its sha256; --resume sets a damaged one
aside, in ckpt/damaged/, and continues from the newest good one). While a run writes the folder, its lock file holds
the run's process id (locked): no other command touches it.

A checkpoint or a summary.json is a run's result, never replaced (claim_folder). A run killed at any point leaves
every file whole: a checkpoint, config.json, summary.json and a rewritten log.csv are written to a .tmp file and
renamed, and each log row is flushed as it is written.

A run folder may still be in progress or may come from an older train.py, so every file and every column is
optional: missing files read as empty, empty cells read as NaN, and settings an older train.py spelled otherwise
read in today's spellings (nanolp.runconfig.as_current); only --resume, which continues the log, needs the log whole
(log_rows). A file that is there but cannot be read (cut short by a full disk or a copy) is DamagedFile, one line
naming it; a checkpoint is checked against the sha256 written beside it (checksum_problem).
"""

import csv
import gzip
import hashlib
import io
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch
import triton

from nanolp.data import TextError
from nanolp.runconfig import ARM, DamagedFile, RunError, as_current, as_ran, describe, read_json


LOCK = "lock"   # in a run folder while a run writes it: that run's process id
CHECKSUM = ".sha256"   # step_N.pt.sha256 beside each checkpoint, as sha256sum writes it (sha256sum -c checks it too)
DAMAGED = "damaged"    # ckpt/damaged/: the checkpoints that --resume found damaged, moved out of its way
KEEP_CKPTS = 3         # the newest checkpoints kept in ckpt/
# Dense (no sparsity) bf16 tensor-core peak of one NVIDIA H200 SXM, from NVIDIA's datasheet: 989 TFLOPS.
# MFU is always reported against this number, whatever device the run is on.
H200_BF16_PEAK_FLOPS = 989e12


@dataclass
class Run:
    path: Path
    config: dict
    summary: dict
    log: dict  # column name -> float array, NaN where the cell was empty

    @property
    def name(self):
        return self.summary.get("name") or self.path.name

    @property
    def arm(self):
        """The sweep's arm: experiments/sweep.py names its runs ARM-sSEED."""
        seed = self.setting("seed")
        return re.sub(rf"-s{seed}$", "", self.name) if seed is not None else self.name

    @property
    def settings(self):
        """Every setting the run recorded, summary.json's (what actually ran) over config.json's."""
        return {**self.config, **{k: v for k, v in self.summary.items() if v is not None}}

    def setting(self, key, default=None):
        """A run setting, from summary.json first (what actually ran), then config.json."""
        for source in (self.summary, self.config):
            if source.get(key) is not None:
                return source[key]
        return default

    def series(self, column, x="step"):
        """(x, values) of one log column against column x, rows with an empty cell dropped;
        None if either column is absent or has no data."""
        if column not in self.log or x not in self.log:
            return None
        keep = np.isfinite(self.log[column]) & np.isfinite(self.log[x])
        if not keep.any():
            return None
        return self.log[x][keep], self.log[column][keep]

    def columns(self, pattern):
        """Log columns whose whole name matches a regex, in the order of their trailing number."""
        found = [c for c in self.log if re.fullmatch(pattern, c)]
        return sorted(found, key=lambda c: int(re.findall(r"\d+", c)[-1]))

    @property
    def collapse_step(self):
        return self.summary.get("collapse_step") if self.summary.get("collapsed") else None

    @cached_property
    def summarised(self):
        """Whether summary.json tells how the run ended. train.py writes it when a run ends by itself (a collapse,
        its --steps or its --minutes), so a run without one, or whose log goes on past it (resumed, then killed),
        has not ended so: it was killed, or it is still running."""
        return bool(self.summary) and log_outcome(self.log)["steps"] <= self.summary.get("steps", 0)

    @property
    def ended(self):
        """How the run ended: "collapsed"; "finished", at its --steps or --minutes without a collapse; "running" (a
        live process holds its lock); or "stopped" before its end (killed)."""
        if self.collapse_step is not None:
            return "collapsed"
        if lock_holder(self.path) is not None:
            return "running"
        return "finished" if self.summarised else "stopped"

    @cached_property
    def outcome(self):
        """steps, minutes, final losses, max_logit, tokens_per_s and the rest of summary.json: the summary's where
        it has them, else what the log says (log_outcome: a run in progress, or killed before or after its
        summary)."""
        summary = self.summary if self.summarised else {}
        return {**log_outcome(self.log), **{k: v for k, v in summary.items() if v is not None}}


def log_outcome(log):
    """What a log (column -> array, as read_log gives) says of its run; train.py's summary.json is built from it.
    The final train loss is the last row's (every row has one), None if it is not finite: the run ended in a
    non-finite loss. The final val loss is the last evaluated one (only some rows have one)."""
    finite = lambda column: log.get(column, np.array([]))[np.isfinite(log.get(column, np.array([])))]
    last_row = lambda column: float(log[column][-1]) if column in log and len(log[column]) else None
    val, speeds = finite("val_loss"), finite("tokens_per_s")
    logits = np.concatenate([finite(c) for c in log if re.fullmatch(r"max_logit_L\d+", c)] or [np.array([])])
    train_loss = last_row("train_loss")
    return dict(steps=int(last_row("step") or 0), minutes=(last_row("elapsed_s") or 0.0) / 60,
                final_val_loss=float(val[-1]) if len(val) else None,
                final_train_loss=train_loss if train_loss is not None and math.isfinite(train_loss) else None,
                max_logit=float(logits.max()) if len(logits) else None,   # the largest seen over the whole run
                tokens_per_s=float(np.median(speeds)) if len(speeds) else None)   # the median skips compile time


def provenance(device):
    """What a run ran: the git commit of this checkout (and whether its tracked files had uncommitted changes),
    and the versions and the GPU it ran on (device's; None on a CPU, even where a GPU is there). Recorded in
    config.json and summary.json, so that runs made before and after a change of the code can be told apart.
    $NANOLP_COMMIT, where set, names the commit of a copy of the tree whose own git metadata is missing or stale (a
    lent GPU machine); None where nothing can be known."""
    if os.environ.get("NANOLP_COMMIT"):   # the caller's word for the tree it copied; uncommitted changes unknown
        commit, dirty = os.environ["NANOLP_COMMIT"], None
    else:
        commit, dirty = git_state(Path(__file__).resolve().parent.parent)
    return dict(commit=commit, dirty=dirty, python=platform.python_version(), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else None)


def git_state(root):
    """(commit, whether tracked files differ from it) of the checkout at root; (None, None) without git."""
    git = lambda *args: subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    try:
        head, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
        commit = head.stdout.strip() if head.returncode == 0 else None
        dirty = bool(status.stdout.strip()) if commit and status.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):   # no git on this machine
        commit = dirty = None
    return commit, dirty


def checkpoints(run_dir):
    """The run's checkpoints, oldest first (not those in ckpt/damaged/): by step, which the names' 7 digits order
    only below 10,000,000."""
    found = [path for path in (Path(run_dir) / "ckpt").glob("step_*.pt") if path.stem[len("step_"):].isdigit()]
    return sorted(found, key=checkpoint_step)


def checkpoint_step(path):
    """The step a checkpoint (ckpt/step_NNNNNNN.pt) was saved at."""
    return int(Path(path).stem[len("step_"):])


def latest_checkpoint(run_dir):
    """The newest checkpoint, whether or not it is damaged: a damaged one is still a run's result until --resume
    moves it to ckpt/damaged/."""
    ckpts = checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def checksum_path(ckpt):
    return ckpt.with_name(ckpt.name + CHECKSUM)


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksum(ckpt, written):
    """Record the sha256 of `written`, the file that is about to be renamed ckpt. Written before that rename, so
    that a checkpoint never exists without its checksum, wherever a run is killed."""
    checksum_path(ckpt).write_text(f"{sha256(written)}  {ckpt.name}\n")


def checksum_problem(ckpt):
    """Why ckpt fails its check, or None: its sha256 is the one recorded when it was written, or it has no
    checksum (it was written by a train.py that recorded none)."""
    recorded = checksum_path(ckpt)
    if not recorded.exists():
        return None
    if recorded.read_bytes().split()[:1] != [sha256(ckpt).encode()]:
        return f"its sha256 is not the one recorded in {recorded.name} when it was written"
    return None


def set_aside(ckpt):
    """Move a damaged checkpoint and its checksum to ckpt/damaged/: out of the way of the checkpoints after it and
    of their pruning, but kept, to look at. Returns that folder."""
    damaged = ckpt.parent / DAMAGED
    damaged.mkdir(exist_ok=True)
    for file in (ckpt, checksum_path(ckpt)):
        if file.exists():
            os.replace(file, damaged / file.name)
    return damaged


def save_checkpoint(run_dir, model, optimizer, state):
    """Write ckpt/step_XXXXXXX.pt and its checksum, then keep only the newest KEEP_CKPTS. The checkpoint is written
    to a .tmp file and renamed, after its checksum: a run killed at any point leaves either a whole, checked
    checkpoint or none under that name (and what it left half-done goes at the next save)."""
    ckpt_dir = run_dir / "ckpt"
    ckpt_dir.mkdir(exist_ok=True)
    path = ckpt_dir / f"step_{state['step']:07d}.pt"
    tmp = path.with_name(path.name + ".tmp")
    rng = {"cpu": torch.get_rng_state()}   # --stochastic-o draws from torch's generator: resume continues its stream
    device = next(model.parameters()).device   # (the run's card's generator, whichever card is current)
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "state": state, "rng": rng}, tmp)
    write_checksum(path, tmp)
    os.replace(tmp, path)
    keep = {file.name for ckpt in checkpoints(run_dir)[-KEEP_CKPTS:] for file in (ckpt, checksum_path(ckpt))}
    for file in ckpt_dir.iterdir():
        if file.is_file() and file.name not in keep:   # older checkpoints, and the .tmp and checksum of a killed save
            file.unlink()


def resume(run_dir, c, model, optimizer, columns):
    """--resume: the loop's state of the run's newest good checkpoint (load_checkpoint), its model and optimizer
    restored and its log cut back to it (the rows after it will be written again). RunError, before the log is cut,
    if the log is missing or damaged (log_rows); if --steps is below the steps the run has recorded (its
    summary.json's or its log's), which would cut them back and write over its summary; or if the run has reached
    its --steps or --minutes already (a run killed after its last checkpoint but before its summary resumes to
    write that summary)."""
    rows, summary = log_rows(run_dir), read_json(run_dir / "summary.json")
    logged, ckpt = max(int(row["step"]) for row in rows), latest_checkpoint(run_dir)
    if ckpt is not None and checkpoint_step(ckpt) > logged:   # (a checkpoint follows its step's row)
        raise DamagedFile(f"--resume: {run_dir / 'log.csv'} ends at step {logged:,}, before the checkpoint of step "
                          f"{checkpoint_step(ckpt):,}: the rows between are lost (the file cut short); nothing changed")
    recorded = max([logged, summary.get("steps") or 0])
    if c["steps"] < recorded:   # (before a damaged checkpoint is set aside: nothing changes)
        raise RunError(f"--resume: {run_dir} has recorded {recorded:,} steps: --steps {c['steps']:,} would cut it "
                       f"back; give --steps {recorded:,} or more; nothing changed")
    finished = summary and limits_reached(c, summary.get("steps") or 0, summary.get("minutes") or 0)
    if finished:   # (whichever checkpoint would load: an earlier one, the last damaged, would train it again)
        raise RunError(f"--resume: {run_dir}: {done(summary['steps'])}; give a larger "
                       f"{' and a larger '.join(finished)} to train it further")
    state = load_checkpoint(run_dir, model, optimizer, torch.device(c["device"]))
    reached = limits_reached(c, state["step"], state["elapsed"] / 60)
    if (run_dir / "summary.json").exists() and reached:
        raise RunError(f"--resume: {run_dir}: {done(state['step'])}; give a larger {' and a larger '.join(reached)} "
                       f"to train it further")
    write_rows(run_dir / "log.csv", [row for row in rows if int(row["step"]) <= state["step"]], columns, "w")
    print(f"resuming {run_dir} at step {state['step']}")
    return state


def log_rows(run_dir):
    """The rows of a run's log.csv, for --resume to continue, each with a step; RunError in one line if the log is
    missing, cannot be read (read_rows), holds no row or a row without a whole-number step: a run with a checkpoint
    has logged its steps up to it, and would lose them."""
    path = run_dir / "log.csv"
    try:
        rows = read_rows(path, appended=True)
    except FileNotFoundError:
        raise RunError(f"--resume: {path} is missing: the run's log cannot be continued; nothing changed") from None
    except ValueError as e:
        raise DamagedFile(f"--resume: {e}: the run's log cannot be continued; nothing changed") from None
    if not rows:
        raise DamagedFile(f"--resume: {path} holds no rows, though the run has a checkpoint: its log is lost; "
                          f"nothing changed")
    if bad := next((row for row in rows if not str(row.get("step")).isdigit()), None):
        raise DamagedFile(f"--resume: {path} is damaged: a row's step is {bad.get('step')!r}, not a whole number; "
                          f"nothing changed")
    return rows


def load_checkpoint(run_dir, model, optimizer, device):
    """Restore the newest good checkpoint. A checkpoint that fails its checksum or cannot be read is named in one
    line, moved to ckpt/damaged/ (set_aside), and the one before it tried; RunError if none is good, or if the model
    does not fit it (config.json edited)."""
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
    if "cuda" in rng and device.type == "cuda":
        torch.cuda.set_rng_state(rng["cuda"].cpu(), device)
    return ckpt["state"]


def misfit(model, weights):
    """The first tensor in which a model and a checkpoint's weights differ in shape, or that one of them lacks, in
    words; None if the weights fit."""
    shapes = lambda tensors: {name: "x".join(map(str, t.shape)) for name, t in tensors.items()}
    ours, theirs = shapes(model.state_dict()), shapes(weights)
    for name in [*ours, *theirs]:
        if ours.get(name) != theirs.get(name):
            return f"{name}: {theirs.get(name, 'none')} in the checkpoint, {ours.get(name, 'none')} in the model"
    return None


def lock_holder(run_dir):
    """The process id in run_dir's lock if that process is alive (a run is writing the folder), else None: a lock
    whose process is gone was left by a run that was killed, and is stale. RunError for a lock this user cannot
    read (another user's run may be writing the folder)."""
    lock = Path(run_dir) / LOCK
    try:
        pid = int(lock.read_text())
    except (FileNotFoundError, ValueError):
        return None
    except OSError as e:
        raise RunError(f"cannot read the lock {lock} ({e.strerror}): if no run is writing {run_dir}, "
                       f"delete it") from None
    if pid <= 0:   # (os.kill would signal a process group)
        return None
    try:
        os.kill(pid, 0)   # signal 0 sends nothing: it only asks whether the process exists
    except ProcessLookupError:
        return None
    except PermissionError:   # alive, another user's
        pass
    return pid


@contextmanager
def locked(run_dir):
    """Hold run_dir's lock (making the folder) while the block writes the folder; RunError if a live run holds it."""
    run_dir = Path(run_dir)
    lock, mine = run_dir / LOCK, run_dir / f"{LOCK}.{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        mine.write_text(str(os.getpid()))
    except OSError as e:
        raise RunError(f"cannot write the run folder {run_dir}: {e.strerror}") from None
    try:
        while True:
            try:
                os.link(mine, lock)   # atomic, and the lock never exists without its process id in it
                break
            except FileExistsError:
                pid = lock_holder(run_dir)
                if pid is not None:
                    raise RunError(f"{run_dir} is being written by a live run (process {pid}): wait for it to end, "
                                   f"or give this run another --name (if no run is writing it, delete {lock})")
                lock.unlink(missing_ok=True)   # stale
            except OSError as e:   # the link is the lock: a filesystem without hard links cannot hold one
                raise RunError(f"cannot lock the run folder {run_dir} ({e.strerror}): runs are written where the "
                               f"filesystem allows hard links; give another --out") from None
    finally:
        mine.unlink()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def claim_folder(run_dir, c, resume, presets):
    """Refuse (RunError) unless this command may write run_dir, whose lock it holds. A checkpoint or a summary.json
    is a run's result, never replaced: a new run refuses such a folder, and --resume continues it, unless it
    collapsed (the collapse is the result; continuing would write over it). An attempt that stopped before its
    first checkpoint has nothing to continue: a new run replaces it. One whose checkpoints --resume found all
    damaged has nothing to continue either, but it trained: its log and its damaged checkpoints are kept (a new run
    takes another --name)."""
    ckpt, summary = latest_checkpoint(run_dir), read_json(run_dir / "summary.json")
    collapse = (f"it collapsed at step {summary.get('collapse_step')} ({summary.get('reason')})"
                if summary.get("collapsed") else None)
    if resume:
        if collapse:
            raise RunError(f"--resume: {run_dir} is kept as it ended: {collapse}; start a new run with another --name")
        if ckpt is None:
            raise nothing_to_resume(run_dir)
    elif ckpt or summary:
        saved = read_json(run_dir / "config.json")
        if not saved:
            raise RunError(f"{run_dir} holds a run without config.json: pass --name for a new run")
        ran = as_ran(saved, presets)
        differ = [f"{k} {c[k]!r} (the run: {ran.get(k)!r})" for k in ARM if c[k] != ran.get(k)]
        afresh = f"or delete {run_dir} to start it afresh"
        finished = summary and ckpt and limits_reached(c, checkpoint_step(ckpt), summary.get("minutes", 0))
        advice = (f"this command differs in {', '.join(differ)}: give it another --name (--resume would refuse), "
                  f"{afresh}" if differ else f"{collapse}: give a new run another --name, {afresh}" if collapse else
                  f"{done(summary.get('steps', 0))}: --resume with a larger {' and a larger '.join(finished)} trains it "
                  f"further, --name "
                  f"starts a new run, {afresh}"
                  if finished else f"pass --resume to continue it, --name for a new run, {afresh}" if ckpt else
                  f"its summary.json is kept but its checkpoints are gone, so it cannot be continued: --name starts "
                  f"a new run, {afresh}")
        raise RunError(f"{run_dir} exists, a run of {describe(ran, presets)}: {advice}")
    elif (run_dir / "ckpt" / DAMAGED).exists():   # every checkpoint damaged: a run that trained, kept to look at
        raise RunError(f"{run_dir} holds a run whose checkpoints are all damaged (in {run_dir / 'ckpt' / DAMAGED}): "
                       f"--name starts a new run, or delete {run_dir} to start it afresh")
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


def limits_reached(c, step, minutes):
    """Which of its --steps and --minutes (settings c) a run at `step`, after `minutes` of training, has reached:
    resuming it while either is would train no step."""
    return [flag for flag, hit in (("--steps", step >= c["steps"]),
                                   ("--minutes", c["minutes"] is not None and minutes >= c["minutes"])) if hit]


def done(steps):
    """What a finished run's folder says of it."""
    return f"it is finished: no collapse in {steps:,} steps (summary.json)"


def nothing_to_resume(run_dir):
    """--resume's refusal of a run with no checkpoint to continue from, and how to start it afresh: in its folder
    (an attempt is replaced), or, beside a summary.json (a result, never replaced), under another --name."""
    ckpt_dir, summary = run_dir / "ckpt", (run_dir / "summary.json").exists()
    damaged = (ckpt_dir / DAMAGED).exists()
    why = (f"no good checkpoint in {ckpt_dir} (the damaged ones are in {ckpt_dir / DAMAGED})" if damaged else
           f"no checkpoint in {ckpt_dir} (" + ("its summary.json is kept, its checkpoints are gone)" if summary else
                                               "the run stopped before its first)"))
    afresh = ("start it afresh under another --name" if summary or damaged
              else "leave out --resume to start it afresh")
    return RunError(f"--resume: {why}: {afresh}")


def outcome(summary):
    """A run's outcome (write_summary's) in words: where it collapsed and why, or how long it trained without."""
    if summary["collapsed"]:
        return (f"collapsed at step {summary['collapse_step']:,}, after {summary['collapse_minute']:.1f} training "
                f"minutes: {summary['reason']}")
    return f"no collapse in {summary['steps']:,} steps ({summary['minutes']:.1f} training minutes)"


class Stopped(Exception):
    """Ctrl-C during training, at a step (the number of steps trained) of the run c in run_dir, its summary written
    or None: its message says where the run stopped and how to continue it, or that it had ended."""
    def __init__(self, run_dir, c, step, summary=None):
        super().__init__(stopped(run_dir, c, step, summary))


def stopped(run_dir, c, step, summary=None):
    """What a run that Ctrl-C stopped at `step` says, in one line: with its summary written, that the run has ended
    and how; else its last checkpoint, and the command that continues from it (--out and --name find the run; its
    config.json holds the rest of its settings)."""
    if summary is not None:
        return f"stopped at step {step}, the run ended: {outcome(summary)}; {run_dir / 'summary.json'} holds it"
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return (f"stopped at step {step}, before the run's first checkpoint (every {c['ckpt_interval']:,} steps): "
                f"nothing to resume; the same command starts the run again")
    resume = shlex.join(["python", "train.py", "--resume", "--out", c["out"], "--name", c["name"]])
    return f"stopped at step {step}; last checkpoint {ckpt}; to continue from it: {resume}"


@contextmanager
def refusals():
    """train.py's two ends other than a run's own, as a command line ends: a command that cannot run as given (a
    setting, the text, the run folder: RunError, TextError) in one line per problem on stderr, exit status 2, as
    argparse refuses a malformed flag; Ctrl-C (Stopped) in the line that continues the run, exit status 130, and
    before training began in a line that says so."""
    try:
        yield
    except (RunError, TextError) as e:
        for line in str(e).splitlines():
            print(f"train.py: error: {line}", file=sys.stderr)
        raise SystemExit(2) from None
    except Stopped as e:   # (the run folder's lock is let go by now)
        print(f"train.py: {e}", file=sys.stderr)
        raise SystemExit(130) from None   # 128 + SIGINT, the status a shell gives a command that Ctrl-C ended
    except KeyboardInterrupt:   # Ctrl-C before train.py's loop (the text, the folder, the model): nothing trained
        print("train.py: stopped before the first training step: nothing was trained; the same command runs it "
              "again", file=sys.stderr)
        raise SystemExit(130) from None


def write_json(path, value):
    """path written whole or not at all (a temporary file, then a rename): a run killed as it writes its config.json
    or summary.json leaves the last complete one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


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


def mfu(c, tokens_per_s):
    """Model FLOPs utilisation at tokens_per_s, against one H200's bf16 peak (H200_BF16_PEAK_FLOPS)."""
    return c["flops_per_token"] * tokens_per_s / H200_BF16_PEAK_FLOPS


def write_summary(run_dir, c, collapse):
    """summary.json, from log.csv (so a resumed run summarises all of itself: log_outcome, which also reads runs that
    ended without one) and the collapse, if any."""
    outcome = log_outcome(read_log(run_dir / "log.csv"))
    device = torch.device(c["device"])
    summary = dict(
        collapsed=collapse is not None,
        collapse_step=(collapse or {}).get("step"),
        collapse_minute=(collapse or {}).get("minute"),
        reason=(collapse or {}).get("reason"),
        **outcome,   # steps, minutes, final losses (None after a non-finite loss), max logit, tokens/s
        mfu=mfu(c, outcome["tokens_per_s"] or 0.0),
        peak_mem_gb=torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        name=c["name"], **{k: c[k] for k in ARM}, data_sha1=c["data_sha1"],   # the arm, whole
        provenance=provenance(device),   # of this invocation (a resumed run's config.json keeps its first one's)
    )
    write_json(run_dir / "summary.json", summary)
    return summary


def log_path(run_dir):
    """A run's log: log.csv as train.py writes it, or log.csv.gz as a thinned, committed copy (thin_log)."""
    plain = Path(run_dir) / "log.csv"
    return plain if plain.exists() else plain.with_suffix(".csv.gz")


def read_log(path):
    """A log as column -> array ({} if there is none). DamagedFile for a file that cannot be read, or with a row of
    more or fewer cells than its header (a copy cut short within its last row, or a line train.py did not write):
    such a row would give the run's steps and outcome wrong, not missing."""
    opener = gzip.open if str(path).endswith(".gz") else open
    if not Path(path).exists():
        return {}
    try:
        with opener(path, "rt", newline="") as f:
            header, rows = csv_rows(f, path, "train.py", appended=True)
    except (UnicodeDecodeError, EOFError, zlib.error, gzip.BadGzipFile, OSError) as e:
        raise DamagedFile(f"{path} cannot be read ({e})") from None
    except ValueError as e:   # (a row not whole, or not CSV: csv_rows's line)
        raise DamagedFile(str(e)) from None
    if "step" in header:   # a row without its step (a header written again, say) would give the run's steps wrong
        at = header.index("step")
        if stray := next((cells for cells in rows if not cells[at].isdigit()), None):
            raise DamagedFile(f"{path}: a row whose step is {stray[at]!r}, not a step number (a line train.py did "
                              f"not write)")
    return {c: np.array([to_float(row[i]) for row in rows]) for i, c in enumerate(header)} if rows else {}


def to_float(cell):
    try:
        return float(cell)
    except ValueError:  # an empty cell
        return math.nan


def load_run(path):
    path = Path(path)
    return Run(path, read_json(path / "config.json"), read_json(path / "summary.json"), read_log(log_path(path)))


def load_runs(paths):
    """The runs at `paths`, less those with a file that cannot be read, without config.json (a log of unknown
    settings) or with a log without a row, each named in one line: a table of many runs is not lost to one damaged
    file."""
    runs = []
    for path in paths:
        try:
            run = load_run(path)
        except DamagedFile as e:
            print(f"{path}: left out, {e}")
            continue
        if not (Path(path) / "config.json").exists():   # (train.py writes it before the log)
            print(f"{path}: left out, it has no config.json: its settings are unknown")
        elif run.series("step") is None:   # stopped before its first log row
            print(f"{path}: left out, its log has no row yet")
        else:
            runs.append(run)
    return runs


def study_runs(table):
    """The runs of a study's runs.csv (experiments/sweep.py writes it beside the study's runs/ folder): each row's
    run folder where its log is kept, else a Run of the row alone, without a log (an earlier run whose log was not
    kept: its settings and outcome). Rows of patched kernels (the `variant` column) are left out: they are no
    train.py command, and their flags would put them in the plain kernel's arm. A kept run that cannot be read
    (a damaged file, or its log gone) is its row alone: it still counts."""
    folder = Path(table).parent / "runs"
    runs = []
    for row in read_table(table):
        if row.get("variant"):
            continue
        try:
            run = load_run(folder / row["name"]) if row["log_kept"] else None
        except DamagedFile:
            run = None
        runs.append(run if run is not None and run.log else Run(folder / row["name"], {}, row, {}))
    return runs


STUDY_COLUMNS = ("name", "arm", "flags", "seed", "lr", "steps", "collapsed", "collapse_step", "log_kept")


def study_rows(tables, columns=STUDY_COLUMNS):
    """The rows of studies' runs.csv (read_table), in order, each with its study's `folder` and its `run_dir`
    (folder/runs/NAME, where a run whose log is kept has it). ValueError in one line for a table given twice, one
    that cannot be read or lacks one of these columns (a reader's, STUDY_COLUMNS and those it reads besides), a row
    without a name, or one that says a run's log is kept where there is none."""
    paths = [Path(table) for table in tables]
    twice = sorted({str(p) for p in paths if [q.resolve() for q in paths].count(p.resolve()) > 1})
    if twice:
        raise ValueError(f"a table given twice would count its runs twice: {', '.join(twice)}")
    rows = []
    for path in paths:
        try:
            table = read_table(path)
        except OSError as e:   # (read_table's ValueError names the file, and line, as OSError's does)
            raise ValueError(str(e)) from None
        missing = [column for column in columns if table and column not in table[0]]
        if missing:
            raise ValueError(f"{path} is not a study's runs.csv: no column {', '.join(missing)}")
        unnamed = [i + 2 for i, row in enumerate(table) if not row["name"]]   # (its line: the header is line 1)
        if unnamed:
            raise ValueError(f"{path}, line {unnamed[0]}: a run without a name")
        table = [dict(row, folder=path.parent, run_dir=path.parent / "runs" / row["name"]) for row in table]
        gone = [str(row["run_dir"]) for row in table if row["log_kept"] and not log_path(row["run_dir"]).exists()]
        if gone:
            raise ValueError(f"{path} says these runs' logs are kept, but there is none in {', '.join(gone)}")
        rows += table
    return rows


TEXT_COLUMNS = ("name", "arm", "flags")   # read as written: a run named "0" or "1e3" is no number


def read_table(path):
    """The rows of a CSV table (a study's runs.csv), each cell the value it spells (from_cell; TEXT_COLUMNS as
    written), the settings in today's spellings (as_current); ValueError, naming the file and line, for a row that is not whole (read_rows)."""
    return [as_current({k: v if k in TEXT_COLUMNS else from_cell(v) for k, v in row.items()})
            for row in read_rows(path)]


def read_rows(path, appended=False):
    """A CSV file's rows, each a dict of its header's columns and their cells (as csv.DictReader gives them, blank
    lines skipped). ValueError in one line naming the file for text that is not UTF-8 or not CSV, or naming the
    line for a row with more or fewer cells than the header (as a file cut short leaves its last): never a row
    read with cells missing, which would read as empty and so give a wrong number rather than none. appended: the
    file is one a run appends rows to (csv_rows)."""
    with open(path, newline="") as f:
        try:
            header, rows = csv_rows(f, path, "its writer", appended)
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not UTF-8 text ({e.reason})") from None
    return [dict(zip(header, cells)) for cells in rows]


def csv_rows(f, path, writer, appended=False):
    """The header and the rows (lists of cells) of an open CSV file, blank lines skipped; ValueError naming path's
    line for a row with more or fewer cells than the header (a file cut short within its last row, or a line its
    writer did not write) or text that is not CSV. appended (a log a run appends to): a last line without its line
    end is a row still being written, or cut short as it was (a kill), and is left out, whatever it holds: cut
    within its last cell it would read as a whole row with a wrong number."""
    text = f.read()
    if appended and not text.endswith("\n"):
        text = text[:text.rfind("\n") + 1]
    reader = csv.reader(io.StringIO(text))
    try:
        header, rows = next(reader, []), []
        for cells in filter(None, reader):
            if len(cells) != len(header):
                raise ValueError(f"{path}, line {reader.line_num}: {len(cells)} cells where the header has "
                                 f"{len(header)} (the file cut short, or a line not written by {writer})")
            rows.append(cells)
    except csv.Error as e:
        raise ValueError(f"{path}, line {reader.line_num}: not CSV ({e})") from None
    return header, rows


def from_cell(text):
    """A CSV cell as the value it spells: None, a bool, an int, a float or the text."""
    if text == "":
        return None
    if text in ("True", "False"):
        return text == "True"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def thin_log(src, dst, every=100):
    """Copy a log.csv to dst (gzip), keeping every row with diagnostics or a val loss, every `every`-th of the
    others and the last rows: what the figures need, at a size that can be committed. The rows as read_log reads
    them (a last line still being written left out); DamagedFile, dst not written, for a log without a row."""
    header, rows = [], []
    if Path(src).stat().st_size:
        with open(src, newline="") as f:
            try:
                header, rows = csv_rows(f, src, "train.py", appended=True)
            except (UnicodeDecodeError, ValueError) as e:
                raise DamagedFile(f"{src} cannot be read ({e})") from None
    if not rows:
        raise DamagedFile(f"{src} has no row yet")
    at = {column: i for i, column in enumerate(header)}
    has = lambda cells, column: column in at and cells[at[column]] != ""
    keep = [cells for i, cells in enumerate(rows) if has(cells, "max_logit_L0") or has(cells, "val_loss")
            or i % every == 0 or i >= len(rows) - 5]
    with gzip.GzipFile(dst, "wb", mtime=0) as raw, io.TextIOWrapper(raw, newline="") as f:   # same rows, same bytes
        writer = csv.writer(f, lineterminator="\r\n")
        writer.writerows([header] + keep)


def cell(value):
    """CSV text: empty for None/NaN, floats to 6 significant digits."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, float):
        return repr(float(f"{value:.6g}"))
    return value


def write_csv(path, rows, columns):
    """Rows (dicts) as a CSV of these columns, each value written by cell(); whole or not at all, as write_json (a
    study's runs.csv holds rows, of runs whose logs were not kept, that are nowhere else)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in row.items()} for row in rows)
    os.replace(tmp, path)


def find_runs(paths):
    """Run folders among `paths`: each is a run folder (it has a log.csv) or a folder of them. A run given twice
    (itself and its folder) is found once, where it first comes."""
    found = []
    for path in map(Path, paths):
        if log_path(path).exists():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted({p.parent for pattern in ("*/log.csv", "*/log.csv.gz") for p in path.glob(pattern)}))
    unique = {}
    for path in found:
        unique.setdefault(path.resolve(), path)
    return list(unique.values())
