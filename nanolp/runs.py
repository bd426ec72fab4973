"""Read the run folders that train.py writes (config.json, log.csv, summary.json, ckpt/) and a study's runs.csv
(study_runs), the lock that keeps two runs from writing one folder, and write the CSV tables made of them
(write_csv).

A run folder runs/<name>/ holds config.json (every resolved setting), log.csv (one row per log interval, with the
diagnostics of nanolp/diagnostics.py every --diag-interval steps), summary.json (the outcome and the whole arm:
every setting of ARM) and ckpt/ (the last 3 checkpoints, each with its sha256; --resume sets a damaged one aside,
in ckpt/damaged/, and continues from the newest good one).

A run folder may still be in progress or may come from an older train.py, so every file and
every column is optional: missing files read as empty, empty cells read as NaN, and settings an older train.py
spelled otherwise read in today's spellings (as_current). A file that is there but cannot be read (cut short by a
full disk or a copy) is DamagedFile, one line naming it; a checkpoint is checked against the sha256 written beside
it (checksum_problem).
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
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np


LOCK = "lock"   # in a run folder while a run writes it: that run's process id
CHECKSUM = ".sha256"   # step_N.pt.sha256 beside each checkpoint, as sha256sum writes it (sha256sum -c checks it too)
DAMAGED = "damaged"    # ckpt/damaged/: the checkpoints that --resume found damaged, moved out of its way


class RunError(Exception):
    """A command that cannot run as given: a bad setting, or a run folder that it may not write or continue. The
    message says why and what to do, one line per problem; train.py prints it and exits with status 2."""


class DamagedFile(RunError):
    """A run folder's file that is there but cannot be read, as a disk that filled or a copy cut short leaves it:
    the message names it and says why, in one line. train.py refuses the run; analyze.py and the sweep leave the
    run out (load_runs)."""


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


def provenance():
    """What a run ran: the git commit of this checkout (and whether its tracked files had uncommitted changes),
    and the versions and device it ran on. Recorded in config.json and summary.json, so that runs made before
    and after a change of the code can be told apart. $NANOLP_COMMIT, where set, names the commit of a copy of the
    tree whose own git metadata is missing or stale (a lent GPU machine); None where nothing can be known."""
    import torch
    import triton

    if os.environ.get("NANOLP_COMMIT"):   # the caller's word for the tree it copied; uncommitted changes unknown
        commit, dirty = os.environ["NANOLP_COMMIT"], None
    else:
        commit, dirty = git_state(Path(__file__).resolve().parent.parent)
    return dict(commit=commit, dirty=dirty, python=platform.python_version(), torch=torch.__version__,
                triton=triton.__version__, cuda=torch.version.cuda,
                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)


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
    """The run's checkpoints, oldest first (not those in ckpt/damaged/)."""
    return sorted((Path(run_dir) / "ckpt").glob("step_*.pt"))


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


def lock_holder(run_dir):
    """The process id in run_dir's lock if that process is alive (a run is writing the folder), else None: a lock
    whose process is gone was left by a run that was killed, and is stale."""
    try:
        pid = int((Path(run_dir) / LOCK).read_text())
        if pid <= 0:   # (os.kill would signal a process group)
            return None
        os.kill(pid, 0)   # signal 0 sends nothing: it only asks whether the process exists
    except (FileNotFoundError, ValueError, ProcessLookupError):
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
    finally:
        mine.unlink()
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def read_json(path):
    """A config.json or summary.json, its settings in today's spellings (as_current): {} if there is none,
    DamagedFile if it cannot be parsed."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as e:   # not JSON, or not even UTF-8 text
        raise DamagedFile(f"{path} cannot be parsed as JSON ({e})") from None
    if not isinstance(value, dict):   # (train.py writes an object)
        raise DamagedFile(f"{path} holds JSON but not an object")
    return as_current(value)


# The block's options (model.py) as every run recorded before they existed ran them: GPT-2's block
GPT2_BLOCK = {"pos": "learned", "qk_norm": False}


def as_current(settings):
    """A run's settings as an older train.py wrote them (a config.json, a summary.json, a row of runs.csv, typed or
    as text), in today's spellings; every reader of those files gets them through here, and the files, being
    data, stay as written. Before, fix was a bool in some runs (True: "on"); what delta reads was three settings,
    delta_from_p ("p"), delta_fp32 ("fp32-o") and stochastic_o "delta" ("stochastic-o"), now the one setting
    delta; precision "paper", the paper's rounding points under autocast, is "autocast"; a run's settings without
    the block's options ran GPT2_BLOCK. A row's flags (its arm's train.py flags) read likewise. Today's settings
    come back unchanged."""
    settings = dict(settings)
    if "attn" in settings:   # (a run's settings, not another table's row)
        settings = {**GPT2_BLOCK, **settings}
    yes = lambda value: value in (True, "True")   # (a runs.csv cell read as text)
    if settings.get("fix") in (True, False, "True", "False"):
        settings["fix"] = "on" if yes(settings["fix"]) else "off"
    if {"delta_from_p", "delta_fp32"} & set(settings) or settings.get("stochastic_o") == "delta":
        reads = [value for key, value in (("delta_from_p", "p"), ("delta_fp32", "fp32-o")) if yes(settings.get(key))]
        if settings.get("stochastic_o") == "delta":
            reads.append("stochastic-o")
            settings["stochastic_o"] = "off"
        settings["delta"] = reads[0] if reads else "o"   # (train.py refused more than one)
        settings.pop("delta_from_p", None)
        settings.pop("delta_fp32", None)
    if settings.get("precision") == "paper":
        settings["precision"] = "autocast"
    flags = ((r" ?--no-delta-(from-p|fp32)\b", ""), (r"--delta-from-p\b", "--delta p"),   # (as an arm gave them)
             (r"--delta-fp32\b", "--delta fp32-o"), (r"--stochastic-o([= ])delta\b", r"--delta\1stochastic-o"),
             (r"--precision([= ])paper\b", r"--precision\1autocast"))
    if isinstance(settings.get("flags"), str):
        for old, new in flags:
            settings["flags"] = re.sub(old, new, settings["flags"]).strip()
    return settings


def write_json(path, value):
    """path written whole or not at all (a temporary file, then a rename): a run killed as it writes its config.json
    or summary.json leaves the last complete one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def log_path(run_dir):
    """A run's log: log.csv as train.py writes it, or log.csv.gz as a thinned, committed copy (thin_log)."""
    plain = Path(run_dir) / "log.csv"
    return plain if plain.exists() else plain.with_suffix(".csv.gz")


def read_log(path):
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        rows = list(csv.DictReader(f))
    columns = rows[0].keys() if rows else []
    return {c: np.array([to_float(row[c]) for row in rows]) for c in columns}


def to_float(cell):
    try:
        return float(cell)
    except (TypeError, ValueError):  # empty cell, or a short row (None)
        return math.nan


def load_run(path):
    path = Path(path)
    return Run(path, read_json(path / "config.json"), read_json(path / "summary.json"), read_log(log_path(path)))


def load_runs(paths):
    """The runs at `paths`, less those with a file that cannot be read, each named in one line: a table of many runs
    is not lost to one damaged file."""
    runs = []
    for path in paths:
        try:
            runs.append(load_run(path))
        except DamagedFile as e:
            print(f"{path}: left out, {e}")
    return runs


def study_runs(table):
    """The runs of a study's runs.csv (experiments/sweep.py writes it beside the study's runs/ folder): each row's
    run folder where its log is kept, else a Run of the row alone, without a log (an earlier run whose log was not
    kept: its settings and outcome). Rows of patched kernels (the `variant` column) are left out: they are no
    train.py command, and their flags would put them in the plain kernel's arm."""
    folder = Path(table).parent / "runs"
    return [load_run(folder / row["name"]) if row["log_kept"] else Run(folder / row["name"], {}, row, {})
            for row in read_table(table) if not row.get("variant")]


def read_table(path):
    """The rows of a CSV table (a study's runs.csv), each cell the value it spells (from_cell), the settings in
    today's spellings (as_current)."""
    with open(path, newline="") as f:
        return [as_current({k: from_cell(v) for k, v in row.items()}) for row in csv.DictReader(f)]


def from_cell(text):
    """A CSV cell as the value it spells: None, a bool, an int, a float or the text."""
    if text in ("", None):
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
    others and the last rows: what the figures need, at a size that can be committed."""
    with open(src, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    keep = [r for i, r in enumerate(rows)
            if r.get("max_logit_L0") or r.get("val_loss") or i % every == 0 or i >= len(rows) - 5]
    with gzip.GzipFile(dst, "wb", mtime=0) as raw, io.TextIOWrapper(raw, newline="") as f:   # same rows, same bytes
        writer = csv.DictWriter(f, fieldnames=reader.fieldnames)
        writer.writeheader()
        writer.writerows(keep)


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
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in row.items()} for row in rows)


def find_runs(paths):
    """Run folders among `paths`: each is a run folder (it has a log.csv) or a folder of them."""
    found = []
    for path in map(Path, paths):
        if log_path(path).exists():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted({p.parent for pattern in ("*/log.csv", "*/log.csv.gz") for p in path.glob(pattern)}))
    return found
