"""train.py against the faults a long run meets: a kill at any point (between checkpoints, halfway through writing
one, between its checksum and its rename), Ctrl-C, a damaged checkpoint, a damaged or hand-edited config.json or
summary.json, a damaged or lost log.csv, a --resume that would cut back what a run recorded. The standard: a run resumed after any of them logs the same losses, bit for bit, as the same run
uninterrupted; a damaged file is named in one line, never a traceback, and nothing of the run is written over. (The
sweep and analyze.py on damaged folders: their own tests.)"""
import csv
import json
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import train
from nanolp import data
from nanolp.runs import CHECKSUM, checksum_problem
from tests.test_train import read_log, refusal

# a tiny CPU run, a checkpoint every 10 steps
FLAGS = ["--preset", "tiny", "--attn", "sdpa", "--device", "cpu", "--batch-size", "8", "--block-size", "32",
         "--steps", "60", "--log-interval", "10", "--ckpt-interval", "10", "--eval-interval", "30",
         "--diag-interval", "60"]

# train.py in a process that kills itself (SIGKILL: nothing is cleaned up, as when a machine is taken away) at
# one point of step or checkpoint AT: "step" as that step begins; "write" halfway through writing the checkpoint's
# file; "rename" once the file and its checksum are written, before the rename that makes it the checkpoint.
KILLED = r"""
import io, os, signal, sys
from pathlib import Path
import torch
import train
from nanolp import data

data.DATA_DIR = Path(sys.argv[1])
point, at = sys.argv[2], int(sys.argv[3])
die = lambda: os.kill(os.getpid(), signal.SIGKILL)
get_lr, save, replace = train.get_lr, torch.save, os.replace

def get_lr_or_die(step, c):
    if point == "step" and step == at:
        die()
    return get_lr(step, c)

def save_or_die(obj, f):
    if point == "write" and obj["state"]["step"] == at:
        whole = io.BytesIO()
        save(obj, whole)
        Path(f).write_bytes(whole.getvalue()[:whole.tell() // 2])
        die()
    save(obj, f)

def replace_or_die(src, dst):
    if point == "rename" and Path(dst).name == f"step_{at:07d}.pt":
        die()
    replace(src, dst)

train.get_lr, torch.save, os.replace = get_lr_or_die, save_or_die, replace_or_die
train.main(sys.argv[4:])
"""


# train.py in a process that, as step AT begins, touches the file READY and waits there for the test's Ctrl-C
INTERRUPTED = r"""
import signal, sys, time
from pathlib import Path
import train
from nanolp import data

data.DATA_DIR = Path(sys.argv[1])
at, ready = int(sys.argv[2]), Path(sys.argv[3])
# Python's Ctrl-C handler, as a terminal's python has it: a background job of a shell script starts with SIGINT ignored
signal.signal(signal.SIGINT, signal.default_int_handler)
get_lr = train.get_lr

def get_lr_or_wait(step, c):
    if step == at:
        ready.touch()
        time.sleep(600)
    return get_lr(step, c)

train.get_lr = get_lr_or_wait
train.main(sys.argv[4:])
"""


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """A small made-up text, its token cache kept out of the repository (and no $NANOLP_DATA, which would be part
    of every run's arm)."""
    folder = tmp_path_factory.mktemp("text")
    rng = random.Random(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "good", "night", "sweet"]
    path = folder / "words.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(8000)) + "\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NANOLP_DATA", raising=False)
        patch.setattr(data, "DATA_DIR", folder / "data")
        yield path


def command(text, run_dir, *flags):
    return [*FLAGS, "--data", str(text), "--out", str(run_dir.parent), "--name", run_dir.name, *flags]


@pytest.fixture(scope="module")
def whole(text, tmp_path_factory):
    """The run uninterrupted: the standard."""
    run_dir = tmp_path_factory.mktemp("whole") / "run"
    train.main(command(text, run_dir))
    return run_dir


@pytest.fixture
def copy(whole, tmp_path):
    """A copy of the uninterrupted run, to damage."""
    return Path(shutil.copytree(whole, tmp_path / "run"))


def losses(run_dir):
    return [(row["step"], row["train_loss"]) for row in read_log(run_dir)]


def kill(text, run_dir, point, at, *flags):
    done = subprocess.run([sys.executable, "-c", KILLED, str(data.DATA_DIR), point, str(at),
                           *command(text, run_dir, *flags)], cwd=Path(train.__file__).parent,
                          capture_output=True, text=True)
    assert done.returncode == -signal.SIGKILL, done.stdout + done.stderr


def files(run_dir):
    return sorted(p.name for p in (run_dir / "ckpt").iterdir())


def checkpoint_files(*steps):
    return sorted(f"step_{step:07d}.pt{end}" for step in steps for end in ("", CHECKSUM))


def test_a_run_killed_anywhere_resumes_to_the_same_losses(text, whole, tmp_path):
    run_dir = tmp_path / "run"
    kill(text, run_dir, "step", 25)   # between checkpoints: resumes from step 20
    assert files(run_dir) == checkpoint_files(10, 20)
    kill(text, run_dir, "write", 40, "--resume")   # halfway through checkpoint 40: resumes from 30
    assert files(run_dir) == checkpoint_files(10, 20, 30) + ["step_0000040.pt.tmp"]
    assert [row["step"] for row in read_log(run_dir)] == ["10", "20", "30", "40"]   # row 40 goes: written again
    kill(text, run_dir, "rename", 50, "--resume")   # checkpoint 50 and its checksum written, not renamed: from 40
    assert files(run_dir) == sorted(checkpoint_files(20, 30, 40) + ["step_0000050.pt.sha256", "step_0000050.pt.tmp"])
    train.main(command(text, run_dir, "--resume"))
    assert losses(run_dir) == losses(whole)
    assert files(run_dir) == checkpoint_files(40, 50, 60)   # as a run leaves it that was never killed
    assert all(checksum_problem(path) is None for path in (run_dir / "ckpt").glob("*.pt"))


def test_ctrl_c_stops_in_one_line_that_says_how_to_resume(text, whole, tmp_path, capsys):
    """Ctrl-C during training: one line with the step, the last checkpoint and the command that continues the run,
    exit status 130, no traceback; that command resumes it to the uninterrupted run's losses."""
    run_dir, ready = tmp_path / "run", tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(data.DATA_DIR), "25", str(ready),
                                *command(text, run_dir)], cwd=Path(train.__file__).parent, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not ready.exists():   # (a run's start takes a few seconds)
        assert process.poll() is None and time.time() < deadline, process.communicate()
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    resume = f"python train.py --resume --out {shlex.quote(str(tmp_path))} --name run"
    assert process.returncode == 130 and "Traceback" not in err, err
    assert [line for line in err.splitlines() if "train.py" in line] == [   # (the others: the progress bar)
        f"train.py: stopped at step 25; last checkpoint {run_dir}/ckpt/step_0000020.pt; to continue from it: {resume}"]
    assert err.endswith(f"{resume}\n")
    assert files(run_dir) == checkpoint_files(10, 20) and sorted(p.name for p in run_dir.iterdir()) == [
        "ckpt", "config.json", "log.csv"]   # no lock left, and no summary: the run has not ended
    assert [row["step"] for row in read_log(run_dir)] == ["10", "20"]
    python, script, *flags = shlex.split(resume)
    capsys.readouterr()
    train.main(flags)
    assert f"resuming {run_dir} at step 20" in capsys.readouterr().out
    assert losses(run_dir) == losses(whole)


def test_ctrl_c_as_resume_rewrites_the_log_leaves_it_whole(text, copy, monkeypatch):
    """--resume drops the log's rows after its checkpoint by writing the log anew: stopped halfway through, the log
    is as it was."""
    log = (copy / "log.csv").read_bytes()
    def interrupted(self, rows):
        raise KeyboardInterrupt   # with the header written, before the rows
    monkeypatch.setattr(csv.DictWriter, "writerows", interrupted)
    with pytest.raises(SystemExit) as exited:   # (before the first step: one line, no traceback)
        train.main(command(text, copy, "--resume", "--steps", "70"))
    assert exited.value.code == 130 and (copy / "log.csv").read_bytes() == log


def contents(run_dir):
    """Every file of a run folder, and its bytes."""
    return {path.relative_to(run_dir): path.read_bytes() for path in run_dir.rglob("*") if path.is_file()}


# config.json edited by hand: a value of another type, a key that train.py does not write, a model that the
# checkpoints do not fit; and the problem that the one line names after the file's path (vocab: the run's)
EDITS = {"a wrong type": (dict(n_layer="two"), '"n_layer" is "two", not an integer'),
         "an unknown key": (dict(n_layers=3), 'unknown key "n_layers" (did you mean "n_layer"?)'),
         "another shape": (dict(n_embd=128), "its settings make a model that step_0000060.pt does not fit "
                                             "(transformer.wte.weight: {vocab}x64 in the checkpoint, {vocab}x128 in "
                                             "the model): was it edited?")}


@pytest.mark.parametrize("edit, problem", EDITS.values(), ids=EDITS)
def test_an_edited_config_is_named_in_one_line_and_nothing_is_written(text, copy, capsys, edit, problem):
    path = copy / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps(config | edit, indent=2))
    before = contents(copy)
    err = refusal(capsys, lambda: train.main(command(text, copy, "--resume", "--steps", "70")))
    assert err.startswith(f"train.py: error: {path}: {problem.format(vocab=config['vocab_size'])}"), err
    assert err.count("\n") == 1
    assert contents(copy) == before


def cut_short(path, size=1000):
    """As a full disk or a copy cut short leaves a file."""
    path.write_bytes(path.read_bytes()[:size])


def test_a_damaged_checkpoint_is_moved_aside_and_the_run_resumes_from_the_one_before(text, copy, whole, capsys):
    ckpt = copy / "ckpt"
    cut_short(ckpt / "step_0000060.pt")
    (ckpt / "step_0000060.pt.sha256").unlink()   # as a train.py that recorded no checksum left it: loading tells
    changed = bytearray((ckpt / "step_0000050.pt").read_bytes())
    changed[len(changed) // 2] ^= 0xFF   # torch would load this one without complaint: its checksum tells
    (ckpt / "step_0000050.pt").write_bytes(changed)
    # finished (its summary.json): nothing to train, whichever checkpoint would load; the damage is left as found
    before = files(copy)
    assert refusal(capsys, lambda: train.main(command(text, copy, "--resume"))) == (
        f"train.py: error: --resume: {copy}: it is finished: no collapse in 60 steps (summary.json); give a larger "
        f"--steps to train it further\n")
    assert files(copy) == before
    (copy / "summary.json").unlink()   # as a run killed after its last checkpoint, before its summary, leaves it
    train.main(command(text, copy, "--resume"))
    out = capsys.readouterr().out.splitlines()
    at = re.escape(str(ckpt))
    assert re.fullmatch(rf"{at}/step_0000060.pt: skipped, it cannot be read \(\w+: .+\); moved to {at}/damaged", out[0])
    assert out[1:3] == [f"{ckpt}/step_0000050.pt: skipped, its sha256 is not the one recorded in "
                        f"step_0000050.pt.sha256 when it was written; moved to {ckpt}/damaged",
                        f"resuming {copy} at step 40"]
    assert losses(copy) == losses(whole)
    assert files(copy) == ["damaged"] + checkpoint_files(40, 50, 60)
    assert sorted(p.name for p in (ckpt / "damaged").iterdir()) == ["step_0000050.pt", "step_0000050.pt.sha256",
                                                                    "step_0000060.pt"]


def test_with_no_good_checkpoint_resume_says_how_to_start_afresh(text, copy, whole, capsys):
    ckpt = copy / "ckpt"
    for step in (40, 50, 60):
        cut_short(ckpt / f"step_{step:07d}.pt")
    err = refusal(capsys, lambda: train.main(command(text, copy, "--resume", "--steps", "80")))   # to train it on
    assert err == (f"train.py: error: --resume: no good checkpoint in {ckpt} (the damaged ones are in "
                   f"{ckpt}/damaged): start it afresh under another --name\n")   # its summary.json is a result
    assert files(copy) == ["damaged"]
    (copy / "summary.json").unlink()   # as a run killed before its end leaves it
    assert refusal(capsys, lambda: train.main(command(text, copy, "--resume"))).endswith(
        "damaged): start it afresh under another --name\n")
    before = contents(copy)   # a run that trained: its log and its damaged checkpoints are not replaced
    assert refusal(capsys, lambda: train.main(command(text, copy, "--steps", "20"))) == (
        f"train.py: error: {copy} holds a run whose checkpoints are all damaged (in {ckpt}/damaged): --name starts "
        f"a new run, or delete {copy} to start it afresh\n")
    assert contents(copy) == before
    fresh = copy.parent / f"{copy.name}-afresh"
    train.main(command(text, fresh, "--steps", "20"))
    assert losses(fresh) == losses(whole)[:2]


def test_a_summary_without_its_checkpoints_is_not_offered_resume(text, copy, capsys):
    """A finished run copied without ckpt/ (or its checkpoints deleted): its summary.json is a result, and neither
    command offers --resume, which has nothing to continue from."""
    shutil.rmtree(copy / "ckpt")
    before = contents(copy)
    err = refusal(capsys, lambda: train.main(command(text, copy, "--steps", "80")))
    assert "its summary.json is kept but its checkpoints are gone, so it cannot be continued: --name starts a new " \
           "run" in err and "pass --resume" not in err
    assert refusal(capsys, lambda: train.main(command(text, copy, "--resume", "--steps", "80"))) == (
        f"train.py: error: --resume: no checkpoint in {copy / 'ckpt'} (its summary.json is kept, its checkpoints are "
        f"gone): start it afresh under another --name\n")
    assert contents(copy) == before


DAMAGE = {"cut short": b'{"preset": "ti', "zeros": b"\x00" * 300, "not text": b"\xff\xd8\xff", "a list": b"[]"}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE)
@pytest.mark.parametrize("name", ["config.json", "summary.json"])
def test_a_damaged_config_or_summary_is_named_in_one_line(text, copy, capsys, name, damage):
    path = copy / name
    path.write_bytes(damage)
    for flags in (["--resume"], []):
        err = refusal(capsys, lambda: train.main(command(text, copy, *flags)))
        assert re.fullmatch(rf"train.py: error: {re.escape(str(path))} (cannot be parsed as JSON \(.+\)|holds JSON but not an "
                            rf"object)\n", err)
    assert path.read_bytes() == damage


EDITS = {"steps as text": ({"steps": "150000"}, '"steps" is "150000", not an integer'),
         "a list for a setting": ({"fix": ["on"]}, '"fix" is ["on"], not one value'),
         "a collapse without its step": ({"collapsed": True, "collapse_step": None},
                                         '"collapsed" is true without a "collapse_step"')}


@pytest.mark.parametrize("edit, problem", EDITS.values(), ids=EDITS)
def test_a_summary_edited_by_hand_is_named_in_one_line(text, copy, capsys, edit, problem):
    """JSON that train.py did not write (another type, a setting as a list): the run is refused in one line naming the
    file and the key, not a traceback or a report that reads it otherwise; the file is left as it is."""
    path = copy / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **edit}))
    damage = path.read_bytes()
    for flags in (["--resume"], []):
        assert refusal(capsys, lambda: train.main(command(text, copy, *flags))) == \
            f"train.py: error: {path}: {problem}\n"
    assert path.read_bytes() == damage


def test_resume_never_cuts_back_the_steps_a_run_recorded(text, copy, capsys):
    """--resume with a --steps below the steps the run has recorded (its summary.json's, or, killed before its
    summary, its log's) is refused before anything changes: with its last checkpoint damaged, it would continue
    from the one before, cut the log back and write over the summary with the shorter run."""
    cut_short(copy / "ckpt" / "step_0000060.pt")
    before = contents(copy)
    err = refusal(capsys, lambda: train.main(command(text, copy, "--resume", "--steps", "50")))
    assert err == (f"train.py: error: --resume: {copy} has recorded 60 steps: --steps 50 would cut it back; give "
                   f"--steps 60 or more; nothing changed\n")
    assert contents(copy) == before
    (copy / "summary.json").unlink()   # killed before its summary: the log's steps are recorded too
    assert "has recorded 60 steps: --steps 50" in refusal(capsys, lambda: train.main(
        command(text, copy, "--resume", "--steps", "50")))


# log.csv damaged or lost, and what the one line says of it after its path
LOGS = {"missing": (None, " is missing: the run's log cannot be continued"),
        "not text": (lambda log: log + b"\xff\xfe\n", " is not UTF-8 text (invalid start byte)"),
        "a stray line": (lambda log: log + b"garbage,row\n", ", line 8: 2 cells where the header has"),
        "cut short": (lambda log: log[:-60], " ends at step 50, before the checkpoint of step 60: the rows between "
                                             "are lost"),   # (the last row, without its line end, left out)
        "a step not a number": (lambda log: log.replace(b"\n30,", b"\nthirty,"), " is damaged: a row's step is "
                                                                                 "'thirty', not a whole number"),
        "header only": (lambda log: log.split(b"\n")[0] + b"\n", " holds no rows, though the run has a checkpoint"),
        "empty": (lambda log: b"", " holds no rows, though the run has a checkpoint")}


@pytest.mark.parametrize("damage, problem", LOGS.values(), ids=LOGS)
def test_resume_refuses_a_damaged_log_in_one_line(text, copy, capsys, damage, problem):
    """The log is the run's history: --resume, which would cut it back or start it anew, refuses a log that is lost
    or cannot be read, as it is, naming it in one line; nothing changes."""
    log = copy / "log.csv"
    if damage:
        log.write_bytes(damage(log.read_bytes()))
    else:
        log.unlink()
    before = contents(copy)
    err = refusal(capsys, lambda: train.main(command(text, copy, "--resume", "--steps", "70")))
    assert err.startswith(f"train.py: error: --resume: {log}{problem}") and err.endswith("; nothing changed\n"), err
    assert err.count("\n") == 1 and contents(copy) == before


def test_a_config_json_that_holds_no_settings_is_not_called_missing(text, copy, capsys):
    (copy / "config.json").write_text("{}")
    before = contents(copy)
    err = refusal(capsys, lambda: train.main(command(text, copy, "--resume")))
    assert err.startswith(f"train.py: error: --resume: {copy / 'config.json'} holds no settings, so the run cannot "
                          f"be continued as it started")
    assert contents(copy) == before
