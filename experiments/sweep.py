"""Run a study of results/studies.toml: train every (arm, seed) run it declares that is not finished yet, on every
GPU found, then collect the study into results/STUDY/ (runs/<run>/ with thinned logs, and runs.csv), the committed
files its figures are drawn from (analyze.py results/STUDY/runs).

On a fresh GPU machine (any number of GPUs), from the repository's root:

    pip install -r requirements.txt
    python -m experiments.sweep seed_study                   # until every run of the study is finished
    python -m experiments.sweep seed_study --minutes 25      # or in installments: the same command again carries on
    python -m experiments.sweep seed_study --collect         # only collect what runs/seed_study holds
    python -m experiments.sweep --collect DIR... --csv PATH  # one CSV row per run folder, of any runs

TinyShakespeare is downloaded on first use; on a machine without internet, copy it to
data/tinyshakespeare/input.txt first. Then commit results/STUDY/.

A run is train.py with the study's common flags and the arm's, --steps MIN_STEPS (the study's or its seed's),
--seed SEED, --name ARM-sSEED, --out OUT (runs/STUDY). Each invocation looks at every run's folder in OUT and in
results/STUDY/runs/:
    running   a live process holds the run folder's lock (another sweep's run)  -> skipped, left alone
    finished  OUT's summary.json says it collapsed, or that it reached min_steps -> skipped
    collected not in OUT, but finished in results/STUDY/runs/ (run elsewhere)    -> skipped
    resumable a checkpoint in OUT's ckpt/                                        -> train.py --resume
    stale     a log.csv but no checkpoint (stopped before its first one)         -> moved to OUT/.stale/, started again
    new       nothing yet                                                        -> started
    damaged   a config.json or summary.json (or a resumable run's log) unreadable -> left out, named
A run folder whose config.json contradicts its arm's flags (the study was edited) is an error, not reused.

Runs start in this order: the resumable ones, then seed by seed across the arms (every arm's first seed before
any arm's second). Each GPU takes --per-gpu runs side by side (default 1), each run seeing only its GPU
(CUDA_VISIBLE_DEVICES): on an H200, two runs of the default preset side by side trained 4,969 and 4,977 steps a
minute, one alone 10,467 (results/delta_probe/runs/off-s0 and results/seed_study/runs/paper-fp32-o-s0, side by side for
their first 12.5 minutes). Without a GPU only studies of the tiny preset run, on the CPU, one at a time; the
others are refused, being sized for a GPU.

Time: --minutes M is this invocation's wall-clock budget. train.py's --minutes counts only its training loop and
is cumulative over resumes (it is saved in the checkpoint), so a run started with R minutes left gets
--minutes (training minutes it already has) + R - MARGIN; the margin covers start-up and the final evaluation.
A run still alive GRACE seconds past the deadline is terminated; its checkpoints survive, and the next
invocation resumes it. No run is started with less than MIN_MINUTES left. Without --minutes a resumed run's own
limit is lifted (--minutes NO_LIMIT), so a run stopped by an earlier budget goes on to its steps. Stopping the sweep
(Ctrl-C, or SIGTERM) stops its runs too; the same command resumes them.
"""

import argparse
import contextlib
import io
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nanolp.runconfig import (BEFORE_OPTION, GPT2_BLOCK, NUMERICS, PLAIN_NUMERICS, DamagedFile, Parser, RunError,
                              arm_flags, as_current, parse_args, read_json, resolve_config)
from nanolp.runs import (LOCK, checkpoint_step, find_runs, latest_checkpoint, load_run, load_runs, lock_holder,
                         log_outcome, log_path, outcome, read_rows, thin_log, write_csv)

ROOT = Path(__file__).resolve().parent.parent
TRAIN = ROOT / "train.py"
STUDIES = ROOT / "results" / "studies.toml"
# the sweep sets these itself; a study may not
OWNED_FLAGS = ("--name", "--out", "--seed", "--steps", "--minutes", "--resume", "--device")
CPU_PRESETS = ("tiny",)  # train.py's presets small enough for a CPU
MARGIN, MIN_MINUTES, GRACE = 0.5, 1.0, 30.0  # minutes, minutes, seconds (see the top of this file)
DONE = ("finished", "collected")
NO_LIMIT = 1e6  # minutes (about two years): train.py's --minutes for "no limit", which it has no other way to say
# first_growth_*: the first head whose W_Q spectral norm exceeds GROWTH x its value at a quarter of the run
# (early training triples every norm from its initial value, so the first rows are no baseline)
GROWTH = 3.0

COLUMNS = ["name", "arm", "flags", "seed", "attn", "fix", *NUMERICS, *GPT2_BLOCK, "lr", "batch_size", "block_size",
           "n_layer", "n_embd", "steps", "minutes", "collapsed", "collapse_step", "collapse_minute", "reason",
           "max_logit", "tie_rate_final", "tie_rate_head_peak", "final_val_loss", "final_train_loss", "tokens_per_s",
           "peak_mem_gb", "gpu", "first_growth_layer", "first_growth_head", "first_growth_step", "log_kept"]
# a row whose run folder was never kept (an earlier sample of the same arm and seed, known by its summary alone)
# is named ARM-sSEED-nolog, so that a new run of that arm and seed, with its log, takes the plain name
NO_LOG = "-nolog"


class StudyError(ValueError):
    """A studies file, or a run folder, that the sweep cannot go on with."""


# -----------------------------------------------------------------------------
# The studies file


@dataclass
class Study:
    name: str
    min_steps: dict  # seed -> the steps its runs reach unless they collapse
    common: list  # train.py flags of every arm
    arms: dict    # arm name -> (train.py flags, seeds)

    def runs(self, out, results):
        """Every run of the study, arm by arm: its name, arm, seed, min_steps, the arm's flags (with the common
        ones), train.py's flags, and its folders in `out` and in `results`/runs."""
        return [dict(name=f"{arm}-s{seed}", arm=arm, seed=seed, min_steps=self.min_steps[seed],
                     arm_flags=[*self.common, *flags],
                     flags=[*self.common, *flags, "--steps", str(self.min_steps[seed])],
                     dir=Path(out) / f"{arm}-s{seed}", kept=Path(results) / "runs" / f"{arm}-s{seed}")
                for arm, (flags, seeds) in self.arms.items() for seed in seeds]

    @property
    def cpu_sized(self):
        return all(flag_settings([*self.common, *flags]).get("preset", "default") in CPU_PRESETS
                   for flags, _ in self.arms.values())


def load_study(path, name):
    """Study `name` of the studies file at `path` (see results/studies.toml for the format)."""
    path = Path(path)
    try:
        studies = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise StudyError(f"no studies file at {path}") from None
    except OSError as e:   # a folder, say
        raise StudyError(f"cannot read the studies file {path} ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise StudyError(f"{path} is not UTF-8 text ({e.reason})") from None
    except tomllib.TOMLDecodeError as e:
        raise StudyError(f"{path}: {e}") from None
    if name not in studies:
        raise StudyError(f"no study {name!r} in {path} (its studies: {', '.join(studies) or 'none'})")
    table, where = studies[name], f"{path}, study {name}"
    if not isinstance(table, dict) or not re.fullmatch(r"[\w.-]+", name) or set(name) == {"."}:   # ("..": the parent)
        raise StudyError(f"{where}: a study is a table named by a folder name")
    unknown = set(table) - {"min_steps", "seeds", "common", "arms"}
    if unknown:
        raise StudyError(f"{where}: unknown keys {sorted(unknown)} (a study has min_steps, seeds, common, arms)")
    min_steps = table.get("min_steps")
    per_seed = isinstance(min_steps, dict)  # { 0 = 112_600, 1 = 181_500 } (TOML's keys are strings)
    if per_seed and not all(re.fullmatch(r"\d+", seed) for seed in min_steps):
        raise StudyError(f"{where}: min_steps per seed is {{ SEED = STEPS, ... }}, got {min_steps!r}")
    if not all(is_int(n) and n >= 1 for n in (min_steps.values() if per_seed else [min_steps])):
        raise StudyError(f"{where}: min_steps must be a positive whole number, or one per seed, got {min_steps!r}")
    steps = {int(seed): n for seed, n in min_steps.items()} if per_seed else {}
    common = parse_flags(table.get("common", ""), f"{where}, common")
    arms = table.get("arms")
    if not isinstance(arms, dict) or not arms:
        raise StudyError(f"{where}: no arms (an [{name}.arms] table of NAME = \"train.py flags\")")
    parsed = {}
    for arm, spec in arms.items():
        at = f"{where}, arm {arm}"
        if not re.fullmatch(r"[\w.+-]+", arm):
            raise StudyError(f"{at}: an arm's name is letters, digits and _.+- (it names run folders)")
        if isinstance(spec, str):
            spec = dict(flags=spec)
        if not isinstance(spec, dict) or "flags" not in spec or set(spec) - {"flags", "seeds"}:
            raise StudyError(f"{at}: an arm is \"train.py flags\" or {{ flags = \"...\", seeds = [...] }}")
        seeds = spec.get("seeds", table.get("seeds"))
        if not (isinstance(seeds, list) and seeds and all(is_int(s) and s >= 0 for s in seeds)
                and len(set(seeds)) == len(seeds)):
            raise StudyError(f"{at}: seeds must be a list of distinct whole numbers >= 0 (in the arm or the "
                             f"study), got {seeds!r}")
        if per_seed and set(seeds) - set(steps):
            raise StudyError(f"{at}: min_steps names no steps for seeds {sorted(set(seeds) - set(steps))}")
        if not per_seed:
            steps.update(dict.fromkeys(seeds, min_steps))
        parsed[arm] = (parse_flags(spec["flags"], at), seeds)
    return Study(name, steps, common, parsed)


def is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def parse_flags(text, where):
    """train.py flags from a string, checked: none that the sweep sets, nothing that is not a --flag."""
    if not isinstance(text, str):
        raise StudyError(f"{where}: flags are one string, got {text!r}")
    try:
        flags = shlex.split(text)
    except ValueError as e:   # (an unbalanced quote)
        raise StudyError(f"{where}: {e} in {text!r}") from None
    for flag in flags:
        name = flag.split("=")[0]
        if any(owned.startswith(name) for owned in OWNED_FLAGS if name.startswith("--") and len(name) > 2):
            raise StudyError(f"{where}: {flag} is set by the sweep ({', '.join(OWNED_FLAGS)})")
    try:
        flag_settings(flags)
    except ValueError as e:
        raise StudyError(f"{where}: {e}") from None
    return flags


def flag_settings(flags):
    """The train.py settings (config.json's keys) that flags give: ["--fix", "off", "--delta", "p", "--x", "--no-y"]
    -> {"fix": "off", "delta": "p", "x": True, "y": False}."""
    settings, i = {}, 0
    while i < len(flags):
        if not flags[i].startswith("--"):
            raise ValueError(f"{flags[i]!r} is not a --flag")
        name, eq, value = flags[i][2:].partition("=")
        if eq:
            i += 1
        elif i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            value, i = flags[i + 1], i + 2
        else:  # a switch
            value, i = not name.startswith("no-"), i + 1
            name = name.removeprefix("no-")
        settings[name.replace("-", "_")] = value
    return settings


def contradiction(run_dir, flags):
    """'' if run_dir's config.json (or a missing one) agrees with flags, else what disagrees."""
    config = read_json(run_dir / "config.json")
    if not config:
        return ""
    for key, want in flag_settings(flags).items():
        if key not in config:
            return f"its config.json has no setting {key!r} (an older run's, or a flag train.py does not have)"
        have = config[key]
        if key == "data" and have is not None:   # (train.py records the text's absolute path)
            same = Path(have).resolve() == Path(want).resolve()
        elif isinstance(want, bool) or isinstance(have, bool) or have is None:
            same = have is want
        else:
            try:
                same = float(have) == float(want)
            except (TypeError, ValueError):
                same = str(have) == want
        if not same:
            return f"its config.json has {key}={have!r}, the arm's flags say {want!r}"
    return ""


# -----------------------------------------------------------------------------
# Planning: what each run needs


def finished(run_dir, min_steps):
    """Collapsed, or reached min_steps (summary.json, which train.py writes when a run ends)."""
    summary = read_json(Path(run_dir) / "summary.json")
    return bool(summary) and bool(summary.get("collapsed") or summary.get("steps", 0) >= min_steps)


def run_state(run_dir, min_steps):
    """'running', 'finished', 'resumable', 'stale' or 'new' (see the top of this file)."""
    if lock_holder(run_dir) is not None:
        return "running"
    if not log_path(run_dir).exists():
        return "new"  # (a folder with only stdout.log: train.py failed before it started; start again)
    if finished(run_dir, min_steps):
        return "finished"
    return "resumable" if latest_checkpoint(run_dir) is not None else "stale"


def plan(study, out, results):
    """The study's runs, each with its state, in the order they are to start (see the top of this file)."""
    runs = study.runs(out, results)
    for run in runs:
        try:
            run["state"] = run_state(run["dir"], run["min_steps"])
            if run["state"] == "resumable":   # (from its log: one that cannot be read makes the run damaged)
                run["trained_minutes"] = trained_minutes(run["dir"])
            if run["state"] in ("new", "stale") and finished(run["kept"], run["min_steps"]):
                run["state"] = "collected"
            for folder in [run["dir"]] + ([run["kept"]] if run["state"] == "collected" else []):
                why = contradiction(folder, run["arm_flags"])
                if why:
                    raise StudyError(f"{folder}: {why}. The study changed since this run: move the folder away, "
                                     f"or give the arm a new name")
        except RunError as e:   # a damaged file, an unreadable lock: the other runs go on, this one waits for a person
            run["state"], run["damage"] = "damaged", str(e)
    seed_rank = {run["name"]: study.arms[run["arm"]][1].index(run["seed"]) for run in runs}
    return sorted(runs, key=lambda run: (run["state"] != "resumable", seed_rank[run["name"]]))


def trained_minutes(run_dir):
    """Training minutes a resume starts from: the elapsed_s that log.csv recorded at the latest checkpoint's step
    (the checkpoint's own clock, saved after that row's evaluation and diagnostics, is a little more)."""
    step = checkpoint_step(latest_checkpoint(run_dir))
    log = load_run(run_dir).log
    at = np.flatnonzero(log.get("step", np.array([])) == step)
    return float(log["elapsed_s"][at[-1]]) / 60 if len(at) else 0.0


def train_command(run, minutes_left, margin=MARGIN):
    """train.py's argv for one run: the study's flags for it, then the ones the sweep owns."""
    cmd = [sys.executable, str(TRAIN), *run["flags"], "--out", str(run["dir"].parent), "--name", run["dir"].name,
           "--seed", str(run["seed"])]
    if run["state"] == "resumable":
        cmd.append("--resume")
    if minutes_left is not None:
        already = run["trained_minutes"] if run["state"] == "resumable" else 0.0
        cmd += ["--minutes", f"{already + minutes_left - margin:.3f}"]
    elif run["state"] == "resumable" and read_json(run["dir"] / "config.json").get("minutes") is not None:
        cmd += ["--minutes", f"{NO_LIMIT:g}"]   # (an earlier budget's limit, which the run would keep)
    return cmd


def device_slots(per_gpu, cpu_sized, study_name=""):
    """One entry per run that may go at once: a CUDA_VISIBLE_DEVICES value (a GPU takes per_gpu runs, the
    first run of each GPU listed before any GPU's second), or [None], one run on the CPU."""
    import torch  # only when a sweep actually runs
    count = torch.cuda.device_count()
    if count == 0:
        if not cpu_sized:
            raise StudyError(f"no GPU found, and study {study_name} is sized for one: on a CPU only studies of "
                             f"--preset {' or '.join(CPU_PRESETS)} run")
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # the GPUs this process sees, as the machine numbers them
    gpus = visible.split(",")[:count] if visible else [str(i) for i in range(count)]
    return [gpu for _ in range(per_gpu) for gpu in gpus]


def check_flags(runs):
    """Each run's command read as train.py reads it before it writes a run folder (its parser, then its settings'
    checks, nanolp.runconfig.resolve_config), before any run starts: a flag train.py lacks (or abbreviates), a value
    or a setting it refuses, a resumed run whose flags changed, is one line now, the run named, not a train.py that
    exits 2 on the machine taken for it."""
    from train import CHOICES, PRESETS   # import torch: only when runs are to start
    for run in runs:
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                resolve_config(parse_args(train_command(run, None)[2:], PRESETS, CHOICES), PRESETS)
        except SystemExit as e:   # the parser's refusal, `train.py: error: ...`, or its --help
            raise StudyError(f"{run['name']}: " + (said.getvalue().strip() if e.code else
                                                   "--help prints train.py's flags, it starts no run")) from None
        except RunError as e:
            raise StudyError(f"{run['name']}: train.py: error: {e}") from None


def warm_data_cache(flag_lists):
    """Tokenize each distinct text once here, so that parallel runs find the token cache instead of all
    writing it at the same time: a run's text is its --data, else its preset's (--preset corpus), else train.py's
    default. StudyError for a text that cannot be trained on."""
    from nanolp.data import TextError, prepare  # import torch: only when a sweep actually runs
    from train import PRESETS
    texts = set()
    for flags in flag_lists:
        settings = flag_settings(flags)
        texts.add(settings.get("data") or PRESETS.get(settings.get("preset"), PRESETS["default"]).get("data") or "")
    for path in sorted(texts):
        try:
            prepare(path or None)
        except TextError as e:
            raise StudyError(str(e)) from None


# -----------------------------------------------------------------------------
# Running


def interrupt(signum, frame):
    """SIGTERM taken as Ctrl-C, so that the sweep stops its runs before it goes (else they run on, orphaned)."""
    raise KeyboardInterrupt


def sweep(runs, slots, minutes=None, margin=MARGIN, min_minutes=MIN_MINUTES, grace=GRACE, poll=1.0):
    """Start or resume every run of `runs` (from plan(), none of them done), one per entry of `slots` (from
    device_slots()) at a time, within `minutes`. Returns {run name: train.py's return code, or why none}."""
    deadline = None if minutes is None else time.time() + 60 * minutes
    queue, active, results, terminated = list(runs), [], {}, set()  # active: (run, Popen, log file, slot)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        while queue or active:
            left = None if deadline is None else (deadline - time.time()) / 60
            # slots lists each GPU's first slot before any GPU's second, so taking out the first match of each
            # busy one leaves a slot of the least loaded GPU at free[0]
            free = list(slots)
            for *_, slot in active:
                free.remove(slot)
            while queue and free and (left is None or left - margin >= min_minutes):
                run = queue.pop(0)
                try:
                    taken = "a live process took its folder" if lock_holder(run["dir"]) is not None else ""
                except RunError as e:   # (another user's lock)
                    taken = str(e)
                if taken:   # (by another sweep, since the plan)
                    results[run["name"]] = "running elsewhere"
                    print(f"{run['name']}: {taken}: left alone")
                    continue
                active.append(start(run, free.pop(0), left, margin))
            if not active:
                break  # nothing running and too little time left to start anything
            time.sleep(poll)
            late = 0.0 if deadline is None else time.time() - deadline - grace
            for item in list(active):
                run, proc, log, _ = item
                if late > 0 and proc.poll() is None and run["name"] not in terminated:
                    print(f"{run['name']}: past the deadline, terminating (pid {proc.pid})")
                    proc.terminate()
                    terminated.add(run["name"])
                elif late > grace and proc.poll() is None:
                    proc.kill()
                if proc.poll() is not None:
                    log.close()
                    active.remove(item)
                    results[run["name"]] = "terminated" if run["name"] in terminated else proc.returncode
                    try:
                        now = run_state(run["dir"], run["min_steps"])
                    except RunError as e:   # (killed as it wrote its summary.json, say)
                        now = f"damaged: {e}"
                    print(f"{run['name']}: exited {proc.returncode}, now {now}")
    finally:
        signal.signal(signal.SIGTERM, previous)
        for run, proc, log, _ in active:  # interrupted: leave no orphans behind
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


def start(run, slot, minutes_left, margin):
    """Launch one run's train.py on `slot` (a CUDA_VISIBLE_DEVICES value, or None: as this process is),
    its output to the run's stdout.log. Returns (run, Popen, log file, slot)."""
    if run["state"] == "stale":
        stale = run["dir"].parent / ".stale" / f"{run['name']}-{time.strftime('%Y%m%d-%H%M%S')}"
        stale.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(run["dir"], stale)
        print(f"{run['name']}: no checkpoint to resume from; moved to {stale}, starting again")
        run["state"] = "new"
    cmd = train_command(run, minutes_left, margin)
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # stdout.log as it happens
    if slot is not None:
        env["CUDA_VISIBLE_DEVICES"] = slot
    run["dir"].mkdir(parents=True, exist_ok=True)
    log = open(run["dir"] / "stdout.log", "a")
    log.write("$ " + ("" if slot is None else f"CUDA_VISIBLE_DEVICES={slot} ") + shlex.join(cmd) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    where = "the CPU" if slot is None else f"GPU {slot}"
    print(f"{run['name']}: {'resumed' if '--resume' in cmd else 'started'} on {where} (pid {proc.pid})")
    return run, proc, log, slot


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


def collect_row(run, arm=None, flags=None):
    """One CSV row (COLUMNS) of a run (nanolp.runs.Run); arm defaults to the run's name less its -sSEED, flags to
    the train.py flags that set it apart from its preset (nanolp.runconfig.arm_flags)."""
    if flags is None:
        from train import PRESETS   # (import torch: as loading the run did)
        flags = arm_flags(run.settings, PRESETS)
    log = run.log
    tie_rates = [last_finite(log[c]) for c in run.columns(r"tie_rate_L\d+")]
    tie_rates = [t for t in tie_rates if t is not None]
    head_peaks = [np.nanmax(log[c]) for c in run.columns(r"tie_rate_L\d+_H\d+") if np.isfinite(log[c]).any()]
    layer, head, growth_step = first_growth(log)
    s = run.summary
    o = run.outcome
    return dict(
        name=run.name, arm=arm or run.arm, flags=flags, seed=run.setting("seed"),
        **{key: run.setting(key) for key in ("attn", "fix")},
        # a run older than an option ran without it, as its default, but for those of BEFORE_OPTION: left blank
        **{key: run.setting(key, None if key in BEFORE_OPTION else PLAIN_NUMERICS[key]) for key in NUMERICS},
        **{key: run.setting(key) for key in GPT2_BLOCK},
        **{key: run.setting(key) for key in ("lr", "batch_size", "block_size", "n_layer", "n_embd")},
        steps=o["steps"], minutes=o["minutes"],
        **{key: s.get(key) for key in ("collapsed", "collapse_step", "collapse_minute", "reason")},
        max_logit=o["max_logit"],
        tie_rate_final=max(tie_rates) if tie_rates else None,
        tie_rate_head_peak=max(head_peaks) if head_peaks else None,    # the paper's failure starts in a few heads
        final_val_loss=o["final_val_loss"], final_train_loss=o["final_train_loss"],
        tokens_per_s=o["tokens_per_s"], peak_mem_gb=s.get("peak_mem_gb"), gpu=s.get("provenance", {}).get("gpu"),
        first_growth_layer=layer, first_growth_head=head, first_growth_step=growth_step, log_kept=True,
    )


def collect(paths, csv_path):
    """One row per run folder found in `paths` (run folders or folders of them), written to csv_path; a folder with
    a damaged file is left out, in one line. StudyError, csv_path not written, where no run is left."""
    rows = [collect_row(run) for run in load_runs(find_runs(paths))]
    if not rows:
        raise StudyError(f"no readable run folders (with a log.csv or log.csv.gz) in {', '.join(map(str, paths))}; "
                         f"{csv_path} not written")
    columns = COLUMNS
    if Path(csv_path).exists():   # a table may hold rows of runs whose folders are elsewhere, or gone: never lost
        try:
            written = [as_current(row) for row in read_rows(csv_path)]
        except ValueError as e:
            raise StudyError(f"{e}; not rewritten") from None
        gone = [row.get("name") for row in written if row.get("name") not in {r["name"] for r in rows}]
        if gone:
            shown = ", ".join(map(str, gone[:3]))   # (None: a row without a name)
            raise StudyError(f"{csv_path} has rows of {len(gone)} runs these folders do not hold ({shown}"
                             f"{', ...' if len(gone) > 3 else ''}): not rewritten; give a new file, or every folder "
                             f"(a study's runs.csv: python -m experiments.sweep STUDY --collect)")
        # its columns that no run folder tells (late_stage's forked_from, say) kept, each run's cell with it
        extra = [column for column in (written[0] if written else {}) if column not in COLUMNS]
        cells = {row["name"]: row for row in written}
        rows = [{**{column: cells[row["name"]].get(column) for column in extra}, **row} for row in rows]
        columns = COLUMNS + extra
    write_csv(csv_path, rows, columns)
    return rows


def collect_study(study, out, results):
    """Copy each run of the study from `out` into results/runs/ (config.json, summary.json, and log.csv thinned
    by thin_log), unless the copy there is finished and the run in `out` is not; then write results/runs.csv,
    one row per run of the study that results/runs/ holds, in the study's order. A run with a file that cannot be
    parsed, or a log cut short of its summary, is left out, in one line: in `out`, it is not copied (the copy in
    results/runs/ stays); in results/runs/, it has no row."""
    rows, runs = [], study.runs(out, results)
    for run in runs:
        src, dst = run["dir"], run["kept"]
        try:
            if lock_holder(src) is not None:   # (being written: its files may not agree yet)
                raise DamagedFile(f"{src} is being written by a live run")
            # src's files read first: a summary.json (finished) or config.json that cannot be parsed is not copied,
            # nor a log that ends before its summary's steps (cut short by a copy or a full disk), whose thinned
            # copy would replace a whole one
            if (src / "log.csv").exists() and (finished(src, run["min_steps"]) or not finished(dst, run["min_steps"])):
                ran = load_run(src)
                logged = log_outcome(ran.log)["steps"]
                if logged < ran.summary.get("steps", 0):
                    raise DamagedFile(f"{src / 'log.csv'} ends at step {logged:,}, before the "
                                      f"{ran.summary['steps']:,} steps of its summary.json")
                refused = replaces_less(ran, dst)
                if refused:
                    raise DamagedFile(f"{src} {refused}: the collected copy is kept (move one of them aside to "
                                      f"collect the other)")
                # made whole before the copy it replaces is removed, outside runs/ (no reader takes it for a run)
                made = dst.parent.parent / f"{dst.name}.collecting"
                shutil.rmtree(made, ignore_errors=True)
                made.mkdir(parents=True)
                for name in ("config.json", "summary.json"):
                    if (src / name).exists():
                        shutil.copy2(src / name, made / name)
                thin_log(src / "log.csv", made / "log.csv.gz")
                shutil.rmtree(dst, ignore_errors=True)
                dst.parent.mkdir(parents=True, exist_ok=True)
                made.rename(dst)
        except DamagedFile as e:
            print(f"{run['name']}: not collected, {e}")
        if log_path(dst).exists():
            rows += [collect_row(kept, run["arm"], shlex.join(run["arm_flags"])) for kept in load_runs([dst])]
    for path in find_runs([Path(results) / "runs"]):
        if path.name not in {run["name"] for run in runs}:
            print(f"{path}: not a run of study {study.name}: not collected (a row it has in runs.csv is kept)")
    table = Path(results) / "runs.csv"
    kept, columns = kept_rows(table, {row["name"] for row in rows}, Path(results) / "runs")
    write_csv(table, kept + rows, columns)
    return rows


def replaces_less(ran, dst):
    """Why the run `ran` (a run folder's, read) may not replace the copy collected at dst, or None: a collapse
    there is a result, replaced only by the same summary.json (the same run collected again); any other copy only
    by a log that reaches at least as far. A copy that cannot be read is replaced."""
    try:
        kept = load_run(dst) if log_path(dst).exists() else None
    except DamagedFile:
        return None
    if kept is None or not kept.log:
        return None
    if kept.collapse_step is not None and ran.summary != kept.summary:
        return f"is not the run collected at {dst}, which {outcome(kept.summary)}"
    reached, steps = log_outcome(kept.log)["steps"], log_outcome(ran.log)["steps"]
    return f"ends at step {steps:,}, before the collected copy's {reached:,}" if steps < reached else None


def kept_rows(table, names, folder):
    """The rows of an existing runs.csv that are not among `names` (the runs whose folders were just collected), in
    today's spellings (as_current; the other cells as written): a run whose log is still in `folder` (not collected
    this time: damaged, or no longer declared) as it was, and runs whose logs were never kept named ARM-sSEED-nolog
    (NO_LOG); and the columns to write: COLUMNS, then any others that table has."""
    if not table.exists():
        return [], COLUMNS
    try:
        written = read_rows(table)
    except ValueError as e:   # (a row cut short would be written back with its cells empty)
        raise StudyError(f"{e}; {table} not rewritten") from None
    if written and "name" not in written[0]:
        raise StudyError(f"{table} is not a study's runs.csv: no column name; not rewritten")
    rows = [as_current(row) for row in written if row["name"] not in names]
    for row in (row for row in rows if not log_path(Path(folder) / row["name"]).exists()):
        row["log_kept"] = False
        row["name"] += "" if row["name"].endswith(NO_LOG) else NO_LOG
    columns = as_current(dict.fromkeys(written[0] if written else COLUMNS))   # (an older table's, as its rows now read)
    return rows, COLUMNS + [c for c in columns if c not in COLUMNS]


# -----------------------------------------------------------------------------


def main(argv=None):
    p = Parser(prog="python -m experiments.sweep", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("study", nargs="?", help="a study of the studies file")
    p.add_argument("--studies", default=STUDIES, help="the studies file (default results/studies.toml)")
    p.add_argument("--out", help="folder of the study's run folders (default runs/STUDY)")
    p.add_argument("--results", help="where the study is collected (default STUDY/ beside the studies file)")
    p.add_argument("--minutes", type=float, help="wall-clock budget of this invocation (default: none)")
    p.add_argument("--per-gpu", type=int, default=1, help="runs side by side on each GPU (default 1)")
    p.add_argument("--collect", nargs="*", metavar="DIR",
                   help="only collect: the study's runs (no DIR), or these run folders (or folders of them) into --csv")
    p.add_argument("--csv", help="with --collect DIR...: the CSV to write")
    args = p.parse_args(argv)
    if args.minutes is not None and not 0 < args.minutes < float("inf"):   # (nan too)
        p.error("--minutes must be a positive number")

    if args.collect:
        if args.study or not args.csv:
            p.error("--collect DIR... takes --csv PATH and no study (a study collects with --collect alone)")
        if Path(args.csv).is_dir():
            p.error(f"--csv must be a file: {args.csv} is a folder")
        try:
            rows = collect(args.collect, args.csv)
        except StudyError as e:
            p.error(str(e))
        except OSError as e:   # (--csv in a folder that cannot be written)
            p.error(f"{e.strerror}: {e.filename}")
        print(f"{len(rows)} runs -> {args.csv}")
        return 0
    if args.csv:
        p.error("--csv goes with --collect DIR...")
    if not args.study:
        p.error(f"name a study of {args.studies}, or give --collect DIR... --csv PATH")
    if args.per_gpu < 1:
        p.error("--per-gpu must be 1 or more")
    stage = "planning"   # what a Ctrl-C stops
    try:
        study = load_study(args.studies, args.study)
        out = Path(args.out or Path("runs") / study.name)
        results = Path(args.results or Path(args.studies).parent / study.name)
        runs = plan(study, out, results)
        todo = [run for run in runs if run["state"] not in (*DONE, "damaged", "running")]
        starts = args.collect is None and todo
        if starts:
            check_flags(todo)   # (before the machine's GPUs: a study is read anywhere)
        slots = device_slots(args.per_gpu, study.cpu_sized, study.name) if starts else []
        for run in runs:   # (after a study sized for a GPU is refused on a machine without one)
            detail = (f" ({run['kept']})" if run["state"] == "collected" else
                      f", left out: {run['damage']}" if run["state"] == "damaged" else
                      f", left alone: {run['dir'] / LOCK} names a live process (if it is no run of this folder, "
                      f"delete the lock)" if run["state"] == "running" else "")
            print(f"{run['name']}: {run['state']}{detail}")
        if slots:
            warm_data_cache([run["flags"] for run in todo])
            stage = "running"
        returns = sweep(todo, slots, args.minutes) if slots else {}
        stage = "collecting"
        rows = collect_study(study, out, results)
    except StudyError as e:
        p.error(str(e))
    except OSError as e:   # (--out or --results naming a file, say)
        p.error(f"{e.strerror}: {e.filename}")
    except KeyboardInterrupt:
        print({"planning": "stopped before any run started",
               "running": "stopped: the runs were stopped with it; the same command resumes them",
               "collecting": "stopped while collecting, after the runs: --collect collects again"}[stage],
              file=sys.stderr)
        return 130
    print(f"{len(rows)} runs -> {results / 'runs.csv'}, logs in {results / 'runs'}")
    failed = {name: rc for name, rc in returns.items() if isinstance(rc, int) and rc != 0}
    if failed:
        print(f"failed (see <run>/stdout.log): {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
