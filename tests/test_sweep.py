"""experiments/sweep.py: the studies file and its errors, what each run needs, which GPU takes which run,
collecting a study into thinned logs and a CSV (with a fake train.py that writes a run folder in a moment), and one
real tiny study on the CPU."""
import csv
import gzip
import json
import os
import random
import re
import shlex
import shutil
import signal
import threading
import tomllib

import pytest
import torch

from experiments import sweep
from nanolp import data
from nanolp.runconfig import as_current
from nanolp.runs import LOCK, cell, load_run, write_csv

# A stand-in for train.py: writes config.json (its flags), log.csv (a row every 10 steps, diagnostics every 100),
# summary.json and device.txt (CUDA_VISIBLE_DEVICES, start and end time), after --sleep seconds.
FAKE_TRAIN = r'''
import argparse, json, os, time
from pathlib import Path
p = argparse.ArgumentParser()
for flag in ("--out", "--name", "--fix", "--preset", "--data"):
    p.add_argument(flag)
for flag in ("--seed", "--steps", "--collapse-at"):
    p.add_argument(flag, type=int)
p.add_argument("--minutes", type=float)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--resume", action="store_true")
a = p.parse_args()
run = Path(a.out) / a.name
run.mkdir(parents=True, exist_ok=True)
start = time.time()
time.sleep(a.sleep)
(run / "config.json").write_text(json.dumps(vars(a)))
end = a.collapse_at or a.steps
with open(run / "log.csv", "w") as f:
    f.write("step,elapsed_s,train_loss,val_loss,max_logit_L0\n")
    for step in range(10, end + 1, 10):
        diag = "2.5,9.0" if step % 100 == 0 else ","
        f.write(f"{step},{step / 100},{1 / step},{diag}\n")
summary = dict(collapsed=a.collapse_at is not None, collapse_step=a.collapse_at, steps=end, name=a.name, seed=a.seed,
               fix=a.fix)
(run / "summary.json").write_text(json.dumps(summary))
(run / "device.txt").write_text(f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {start} {time.time()}")
'''


def write_run(root, name, config, summary, rows):
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(config))
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    columns = list(dict.fromkeys(k for row in rows for k in row))
    with open(run / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(rows)
    return run


def write_studies(tmp_path, text):
    path = tmp_path / "studies.toml"
    path.write_text(text)
    return path


def one_arm_study(tmp_path, flags, seeds=(0, 1)):
    """A study s of one arm, x, with these train.py flags, to 100 steps, loaded."""
    text = f"[s]\nmin_steps = 100\nseeds = {list(seeds)}\n[s.arms]\nx = \"{flags}\"\n"
    return sweep.load_study(write_studies(tmp_path, text), "s")


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture
def text(tmp_path):
    """A small text for train.py. Its tokens are cached under the repository's data/, removed after."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "good", "night", "sweet"]
    path = tmp_path / "sweep_test_words.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)) + "\n")
    yield path
    shutil.rmtree(data.DATA_DIR / path.stem, ignore_errors=True)


@pytest.fixture
def gpus(monkeypatch):
    """Set how many GPUs torch finds."""
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


# -----------------------------------------------------------------------------
# The studies file


def test_committed_studies():
    seed_study = sweep.load_study(sweep.STUDIES, "seed_study")
    assert set(seed_study.min_steps.values()) == {150_000} and not seed_study.cpu_sized
    assert seed_study.arms["off"] == (["--fix", "off"], list(range(8)))
    assert seed_study.arms["paper-fp32-o"] == (["--fix", "paper", "--delta", "fp32-o"], list(range(8)))
    assert seed_study.arms["paper-precision-on"] == (["--precision", "autocast", "--fix", "on"], [0, 1, 2, 3])
    rounding = sweep.load_study(sweep.STUDIES, "stochastic_rounding")
    assert rounding.arms["delta"] == (["--fix", "off", "--delta", "stochastic-o"], [0, 1, 2])
    probe = sweep.load_study(sweep.STUDIES, "delta_probe")
    assert (probe.min_steps, probe.arms) == ({0: 60_000}, {"off": (["--fix", "off"], [0])})


def test_studies_file_format(tmp_path):
    path = write_studies(tmp_path, """
        [mini]
        min_steps = 1_000
        seeds = [0, 1]
        common = "--preset tiny --lr 3e-3"
        [mini.arms]
        off = "--fix off"
        dfp32 = { flags = "--delta fp32-o --data 'a b.txt'", seeds = [5] }
        [other.arms]
        x = "--fix on"
    """)
    study = sweep.load_study(path, "mini")
    assert (study.name, study.common) == ("mini", ["--preset", "tiny", "--lr", "3e-3"])
    assert study.min_steps == {0: 1000, 1: 1000, 5: 1000}
    assert study.arms == {"off": (["--fix", "off"], [0, 1]),
                          "dfp32": (["--delta", "fp32-o", "--data", "a b.txt"], [5])}
    assert study.cpu_sized
    runs = study.runs(tmp_path / "out", tmp_path / "res")
    assert [run["name"] for run in runs] == ["off-s0", "off-s1", "dfp32-s5"]
    assert runs[2]["flags"] == ["--preset", "tiny", "--lr", "3e-3", "--delta", "fp32-o", "--data", "a b.txt",
                                "--steps", "1000"]
    assert runs[2]["kept"] == tmp_path / "res" / "runs" / "dfp32-s5"


def test_min_steps_per_seed(tmp_path):
    path = write_studies(tmp_path, "[a]\nmin_steps = { 0 = 300, 1 = 500 }\nseeds = [0, 1]\n[a.arms]\nx = '--fix off'\n")
    runs = sweep.load_study(path, "a").runs(tmp_path / "out", tmp_path / "res")
    assert [(run["min_steps"], run["flags"][-1]) for run in runs] == [(300, "300"), (500, "500")]
    # finished by its own seed's steps: 400 steps finish seed 0, not seed 1 (no checkpoint: started again)
    for run in runs:
        write_run(tmp_path / "out", run["name"], dict(fix="off"), dict(steps=400), [dict(step=400)])
    study = sweep.load_study(path, "a")
    assert [run["state"] for run in sweep.plan(study, tmp_path / "out", tmp_path / "res")] == ["finished", "stale"]


@pytest.mark.parametrize("text, study, error", [
    ("[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = '--fix off'", "b", "no study 'b' in .*studies: a"),
    ("[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = '--steps=9'", "a", "--steps=9 is set by the sweep"),
    ("[a]\nmin_steps = 5\nseeds = [0]\ncommon = '--name n'\n[a.arms]\nx = ''", "a", "common: --name is set by"),
    ("[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = 'fix off'", "a", "'fix' is not a --flag"),
    ("[a]\nmin_step = 5\nseeds = [0]\n[a.arms]\nx = '--fix off'", "a", r"unknown keys \['min_step'\]"),
    ("[a]\nseeds = [0]\n[a.arms]\nx = '--fix off'", "a", "min_steps must be a positive whole number"),
    ("[a]\nmin_steps = 5\nseeds = [0, 0]\n[a.arms]\nx = '--fix off'", "a", "arm x: seeds must be a list of distinct"),
    ("[a]\nmin_steps = 5\n[a.arms]\nx = '--fix off'", "a", "seeds must be"),
    ("[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = 3", "a", "an arm is"),
    ("[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\n'x/y' = '--fix off'", "a", "an arm's name"),
    ("[a]\nmin_steps = 5\nseeds = [0]", "a", "no arms"),
    ("['..']\nmin_steps = 5\nseeds = [0]\n['..'.arms]\nx = ''", "..", "a study is a table named by a folder name"),
    ("[a]\nmin_steps = 5\nseeds = [0\n", "a", "studies.toml: Unclosed array"),
    ("[a]\nmin_steps = { x = 5 }\nseeds = [0]\n[a.arms]\nx = ''", "a", "min_steps per seed is"),
    ("[a]\nmin_steps = { 0 = 0 }\nseeds = [0]\n[a.arms]\nx = ''", "a", "min_steps must be a positive"),
    ("[a]\nmin_steps = { 0 = 5 }\nseeds = [0, 1]\n[a.arms]\nx = ''", "a", r"arm x: min_steps names no .* \[1\]"),
])
def test_studies_file_errors(tmp_path, text, study, error):
    with pytest.raises(sweep.StudyError, match=error):
        sweep.load_study(write_studies(tmp_path, text), study)


@pytest.mark.parametrize("flags", ["--seed 3", "--name n", "--out o", "--steps 9", "--minutes 1", "--resume",
                                   "--device cpu", "--dev cpu", "--min 0.1"])   # (a prefix: what was meant)
def test_flags_the_sweep_sets(tmp_path, flags):
    path = write_studies(tmp_path, f"[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = '--fix off {flags}'\n")
    with pytest.raises(sweep.StudyError, match=f"arm x: {flags.split()[0]} is set by the sweep"):
        sweep.load_study(path, "a")


def test_an_unbalanced_quote_is_one_line(tmp_path):
    path = write_studies(tmp_path, "[a]\nmin_steps = 5\nseeds = [0]\n[a.arms]\nx = \"--data 'x\"\n")
    with pytest.raises(sweep.StudyError, match="arm x: No closing quotation in \"--data 'x\""):
        sweep.load_study(path, "a")


def test_missing_studies_file(tmp_path):
    with pytest.raises(sweep.StudyError, match="no studies file"):
        sweep.load_study(tmp_path / "nowhere.toml", "a")
    (tmp_path / "binary.toml").write_bytes(b"\x89PNG\r\n\x1a\n\xd0\xff")
    with pytest.raises(sweep.StudyError, match="binary.toml is not UTF-8 text"):
        sweep.load_study(tmp_path / "binary.toml", "a")
    with pytest.raises(sweep.StudyError, match=r"cannot read the studies file .* \(Is a directory\)"):
        sweep.load_study(tmp_path, "a")


def test_flags_against_a_run_config(tmp_path):
    assert sweep.flag_settings(["--fix", "on", "--lr=1e-3", "--delta", "p", "--x", "--no-y", "--lr", "-2"]) == \
        dict(fix="on", lr="-2", delta="p", x=True, y=False)
    run = tmp_path / "run"
    run.mkdir()
    assert sweep.contradiction(run, ["--fix", "on"]) == ""  # no config.json yet
    (run / "config.json").write_text(json.dumps(dict(fix="on", lr=0.001, delta="o", batch_size=64)))
    assert sweep.contradiction(run, ["--fix", "on", "--lr", "1e-3", "--delta", "o", "--batch-size", "64"]) == ""
    assert "fix='on'" in sweep.contradiction(run, ["--fix", "paper"])
    assert "delta='o'" in sweep.contradiction(run, ["--delta", "p"])
    assert "no setting 'stochastic_o'" in sweep.contradiction(run, ["--stochastic-o", "off"])  # an older run's
    (run / "config.json").write_text(json.dumps(dict(data=str(tmp_path / "text.txt"))))
    assert sweep.contradiction(run, ["--data", os.path.relpath(tmp_path / "text.txt")]) == ""   # as given
    assert "data=" in sweep.contradiction(run, ["--data", "other.txt"])
    # a run recorded in the older spellings (delta_fp32, precision "paper") reads in today's
    (run / "config.json").write_text(json.dumps(dict(fix="on", delta_from_p=False, delta_fp32=True,
                                                     stochastic_o="off", precision="paper")))
    assert sweep.contradiction(run, ["--fix", "on", "--delta", "fp32-o", "--precision", "autocast",
                                     "--stochastic-o", "off"]) == ""
    assert "delta='fp32-o'" in sweep.contradiction(run, ["--delta", "p"])


# -----------------------------------------------------------------------------
# Planning


def test_run_state_and_resume_minutes(tmp_path):
    rows = [dict(step=s, elapsed_s=s * 1.2) for s in (10, 20, 30)]
    assert sweep.run_state(tmp_path / "missing", 100) == "new"
    done = write_run(tmp_path, "done", {}, dict(steps=100, collapsed=False), rows)
    assert sweep.run_state(done, 100) == "finished"
    assert sweep.run_state(done, 200) == "stale"  # a longer target, but nothing to resume from
    crashed = write_run(tmp_path, "crashed", {}, dict(steps=30, collapsed=True, collapse_step=30), rows)
    assert sweep.run_state(crashed, 200) == "finished"
    cut = write_run(tmp_path, "cut", {}, dict(steps=30, collapsed=False), rows)  # stopped by --minutes
    (cut / "ckpt").mkdir()
    for step in (10, 20):
        (cut / "ckpt" / f"step_{step:07d}.pt").write_bytes(b"")
    assert sweep.run_state(cut, 100) == "resumable"
    assert sweep.trained_minutes(cut) == pytest.approx(24 / 60)  # elapsed_s at the step-20 checkpoint
    run = dict(dir=cut, seed=1, state="resumable", flags=["--fix", "off", "--steps", "100"], trained_minutes=24 / 60)
    assert sweep.train_command(run, 10.0, 0.5)[1:] == [
        str(sweep.TRAIN), "--fix", "off", "--steps", "100", "--out", str(tmp_path), "--name", "cut", "--seed", "1",
        "--resume", "--minutes", f"{24 / 60 + 9.5:.3f}"]
    assert "--minutes" not in sweep.train_command(dict(run, state="new"), None)
    assert "--minutes" not in sweep.train_command(run, None)   # no budget, and none in the run's config.json
    (cut / "config.json").write_text(json.dumps(dict(minutes=1.7)))   # stopped by an earlier budget
    assert sweep.train_command(run, None)[-2:] == ["--minutes", "1e+06"]   # no budget now: its limit lifted
    # a folder a live process is writing (another sweep's run) is left alone, whatever it holds
    (cut / LOCK).write_text(str(os.getpid()))
    assert sweep.run_state(cut, 100) == "running"
    (cut / LOCK).unlink()


def test_plan(tmp_path):
    study = sweep.load_study(write_studies(tmp_path, """
        [s]
        min_steps = 100
        seeds = [0, 1, 2]
        [s.arms]
        a = "--fix off"
        b = { flags = "--fix on", seeds = [0, 1] }
    """), "s")
    out, results = tmp_path / "out", tmp_path / "results"
    rows = [dict(step=s, elapsed_s=s / 10) for s in (10, 20)]
    write_run(out, "a-s0", dict(fix="off"), dict(steps=100), rows)                   # reached min_steps
    write_run(out, "a-s1", dict(fix="off"), dict(steps=20, collapsed=True, collapse_step=20), rows)    # collapsed
    write_run(out, "b-s1", dict(fix="on"), None, rows)                               # killed, no checkpoint
    (write_run(out, "a-s2", dict(fix="off"), None, rows) / "ckpt").mkdir()
    (out / "a-s2" / "ckpt" / "step_0000020.pt").write_bytes(b"")                    # killed after a checkpoint
    write_run(results / "runs", "b-s1", dict(fix="on"), dict(steps=100), rows)       # finished elsewhere
    write_run(results / "runs", "b-s0", dict(fix="on"), dict(steps=50), rows)        # collected unfinished
    runs = sweep.plan(study, out, results)
    assert [(run["name"], run["state"]) for run in runs] == [
        ("a-s2", "resumable"),                         # resumable first, then seed by seed across the arms
        ("a-s0", "finished"), ("b-s0", "new"), ("a-s1", "finished"), ("b-s1", "collected")]

    with open(out / "a-s2" / "log.csv", "a") as f:   # a row cut short: damaged, not a run to resume
        f.write("30\n")
    assert [(run["name"], run["state"]) for run in sweep.plan(study, out, results)][-1] == ("a-s2", "damaged")

    (out / "a-s0" / "config.json").write_text(json.dumps(dict(fix="paper")))  # run before the study changed
    with pytest.raises(sweep.StudyError, match="a-s0: its config.json has fix='paper'"):
        sweep.plan(study, out, results)


def test_plan_takes_committed_runs_in_the_older_spellings_as_their_arms(tmp_path):
    """Runs collected before fix, delta and precision took today's spellings (config.json and summary.json with
    delta_from_p, delta_fp32, stochastic_o and precision "paper") are runs of the arms whose flags now say --delta
    and --precision autocast: the seed study's own committed runs, and a copy of one of them recorded as a run of
    the autocast precision with delta from P; collecting that copy gives its row in today's spellings."""
    committed = sweep.ROOT / "results" / "seed_study"
    seed_study = sweep.load_study(sweep.STUDIES, "seed_study")
    states = {run["name"]: run["state"] for run in sweep.plan(seed_study, tmp_path / "none", committed)}
    kept = {path.name for path in (committed / "runs").iterdir()}
    assert kept and all(states[name] == "collected" for name in kept)

    old = tmp_path / "results" / "runs" / "p-s2"
    shutil.copytree(committed / "runs" / "off-fma-s1", old)
    for name in ("config.json", "summary.json"):   # as train.py wrote such a run before
        settings = json.loads((old / name).read_text())
        assert settings["delta_from_p"] is False and "delta" not in settings   # the older spelling, as committed
        settings |= dict(precision="paper", fix="paper", delta_from_p=True, name="p-s2", seed=2)
        (old / name).write_text(json.dumps(settings))
    study = sweep.load_study(write_studies(tmp_path, """
        [s]
        min_steps = 150_000
        seeds = [2]
        [s.arms]
        p = "--precision autocast --fix paper --delta p"
    """), "s")
    (run,) = sweep.plan(study, tmp_path / "out", tmp_path / "results")
    assert run["state"] == "collected"
    (row,) = sweep.collect_study(study, tmp_path / "out", tmp_path / "results")
    assert (row["precision"], row["fix"], row["delta"], row["flags"]) == (
        "autocast", "paper", "p", "--precision autocast --fix paper --delta p")
    settings = json.loads((old / "config.json").read_text()) | dict(delta_from_p=False, delta_fp32=True)
    (old / "config.json").write_text(json.dumps(settings))
    with pytest.raises(sweep.StudyError, match="p-s2: its config.json has delta='fp32-o', the arm's flags say 'p'"):
        sweep.plan(study, tmp_path / "out", tmp_path / "results")


# -----------------------------------------------------------------------------
# Devices


def test_device_slots(gpus, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus(2)
    assert sweep.device_slots(2, cpu_sized=False) == ["0", "1", "0", "1"]  # one run per GPU before any second
    assert sweep.device_slots(1, cpu_sized=True) == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")  # this process sees GPUs 3 and 5 only
    assert sweep.device_slots(2, cpu_sized=False) == ["3", "5", "3", "5"]
    gpus(0)
    assert sweep.device_slots(2, cpu_sized=True) == [None]  # the CPU, one run at a time
    with pytest.raises(sweep.StudyError, match="no GPU found, and study big is sized for one"):
        sweep.device_slots(2, cpu_sized=False, study_name="big")


def test_gpu_study_refused_without_a_gpu(tmp_path, gpus, capsys):
    gpus(0)
    path = write_studies(tmp_path, "[big]\nmin_steps = 5\nseeds = [0]\n[big.arms]\nx = '--fix off'\n")
    with pytest.raises(SystemExit):
        sweep.main(["big", "--studies", str(path), "--out", str(tmp_path / "out")])
    printed = capsys.readouterr()
    assert "no GPU found" in printed.err and printed.out == ""   # refused before the plan's lines
    assert not (tmp_path / "out").exists()


# -----------------------------------------------------------------------------
# Running and collecting (a fake train.py)


@pytest.fixture
def fake_train(tmp_path, monkeypatch):
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    monkeypatch.setattr(sweep, "TRAIN", path)
    monkeypatch.setattr(sweep, "check_flags", lambda runs: None)   # the stand-in takes flags train.py lacks


def device_log(run_dir):
    device, start, end = (run_dir / "device.txt").read_text().split()
    return device, float(start), float(end)


def test_study_on_two_gpus(tmp_path, text, fake_train, gpus, monkeypatch, capsys):
    gpus(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    studies = write_studies(tmp_path, f"""
        [fake]
        min_steps = 2000
        seeds = [0, 1]
        common = "--preset tiny --sleep 1 --data {text}"
        [fake.arms]
        off = "--fix off"
        on = "--fix on"
        crash = {{ flags = "--fix off --collapse-at 500", seeds = [0] }}
    """)
    out, results = tmp_path / "out", tmp_path / "fake"  # the results folder: beside the studies file, by default
    argv = ["fake", "--studies", str(studies), "--out", str(out), "--per-gpu", "2"]
    assert sweep.main(argv) == 0
    names = ["off-s0", "off-s1", "on-s0", "on-s1", "crash-s0"]
    logs = {name: device_log(out / name) for name in names}
    # the first four start at once, seed 0 of every arm first, each on the less loaded GPU; on-s1 waits
    assert [logs[name][0] for name in ("off-s0", "on-s0", "crash-s0", "off-s1")] == ["3", "5", "3", "5"]
    assert logs["on-s1"][1] >= min(end for _, _, end in logs.values())
    for gpu in ("3", "5"):
        spans = [(start, end) for device, start, end in logs.values() if device == gpu]
        at_once = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
        assert at_once == 2

    rows = read_csv(results / "runs.csv")
    assert list(rows[0]) == sweep.COLUMNS and "command" not in rows[0]
    assert [row["name"] for row in rows] == names  # the study's order
    off, crash = rows[0], rows[4]
    assert (off["arm"], off["flags"], off["seed"], off["steps"]) == (
        "off", f"--preset tiny --sleep 1 --data {text} --fix off", "0", "2000")
    assert (crash["arm"], crash["flags"].split()[-2:], crash["collapsed"], crash["steps"]) == (
        "crash", ["--collapse-at", "500"], "True", "500")
    kept = results / "runs" / "off-s0"
    assert sorted(p.name for p in kept.iterdir()) == ["config.json", "log.csv.gz", "summary.json"]
    with gzip.open(kept / "log.csv.gz", "rt") as f:
        thinned = list(csv.DictReader(f))
    steps = [int(row["step"]) for row in thinned]
    assert len(steps) < 200 / 4  # of 200 rows: the 20 with diagnostics, every 100th, the last 5
    assert set(range(100, 2001, 100)) <= set(steps) and steps[-1] == 2000
    assert load_run(kept).outcome["max_logit"] == 9.0  # the committed copy reads as a run

    capsys.readouterr()
    assert sweep.main(argv) == 0  # again: all finished, nothing runs
    assert "started" not in capsys.readouterr().out
    fresh = ["fake", "--studies", str(studies), "--out", str(tmp_path / "elsewhere")]
    assert sweep.main(fresh) == 0  # a fresh machine: every run is in results/ already
    printed = capsys.readouterr().out
    assert "started" not in printed and printed.count(": collected") == 5


def test_study_on_the_cpu_one_at_a_time(tmp_path, text, fake_train, gpus, monkeypatch):
    gpus(0)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    studies = write_studies(tmp_path, f"""
        [cpu]
        min_steps = 100
        seeds = [0, 1, 2]
        [cpu.arms]
        tiny = "--preset tiny --sleep 0.3 --data {text}"
    """)
    res = tmp_path / "res"
    assert sweep.main(["cpu", "--studies", str(studies), "--out", str(tmp_path / "out"), "--results", str(res)]) == 0
    spans = sorted(device_log(tmp_path / "out" / f"tiny-s{seed}") for seed in range(3))
    assert all(device == "None" for device, _, _ in spans)  # CUDA_VISIBLE_DEVICES left as it was
    assert all(prev_end <= start for (_, _, prev_end), (_, start, _) in zip(spans, spans[1:]))
    assert len(read_csv(res / "runs.csv")) == 3


def test_budget(tmp_path, text, fake_train):
    study = one_arm_study(tmp_path, f"--sleep 30 --data {text}")
    runs = sweep.plan(study, tmp_path / "out", tmp_path / "s")
    outcome = sweep.sweep(runs, [None], minutes=0.02, margin=0.0, min_minutes=0.01, grace=0.5, poll=0.1)
    assert outcome == {"x-s0": "terminated", "x-s1": "not started"}  # past the 1.2 s budget and its grace
    assert "--minutes 0.0" in (tmp_path / "out" / "x-s0" / "stdout.log").read_text()


def test_the_data_cache_is_warmed_for_each_runs_text(monkeypatch):
    """The text each run will read: its --data, else its preset's (the corpus preset's own), else TinyShakespeare; a
    text that cannot be read is a StudyError (one line), not a traceback."""
    import train
    from nanolp import data
    read = []
    monkeypatch.setattr(data, "prepare", lambda path=None: read.append(path))
    sweep.warm_data_cache([["--fix", "off"], ["--preset", "corpus", "--fix", "on"], ["--data", "x.txt"],
                           ["--preset", "corpus", "--attn", "fp32"]])
    assert read == [None, train.PRESETS["corpus"]["data"], "x.txt"]
    def missing(path=None):
        raise data.TextError("no text at nowhere.txt")
    monkeypatch.setattr(data, "prepare", missing)
    with pytest.raises(sweep.StudyError, match="no text at nowhere.txt"):
        sweep.warm_data_cache([["--data", "nowhere.txt"]])


def test_a_run_taken_since_the_plan_is_left_alone(tmp_path, text, fake_train, capsys):
    """A second sweep that started a queued run after this one planned it: its folder is not moved or written."""
    study = one_arm_study(tmp_path, f"--data {text}")
    runs = sweep.plan(study, tmp_path / "out", tmp_path / "s")
    taken = tmp_path / "out" / "x-s1"
    taken.mkdir(parents=True)
    (taken / LOCK).write_text(str(os.getpid()))
    assert sweep.sweep(runs, [None], poll=0.1) == {"x-s0": 0, "x-s1": "running elsewhere"}
    assert "x-s1: a live process took its folder: left alone" in capsys.readouterr().out
    assert sorted(p.name for p in taken.iterdir()) == [LOCK]


def test_sigterm_stops_the_runs_too(tmp_path, text, fake_train, capsys):
    """SIGTERM to the sweep stops its train.py as Ctrl-C does (it ran on, orphaned, and a second sweep then moved
    the folder it was writing)."""
    study = one_arm_study(tmp_path, f"--sleep 60 --data {text}", seeds=[0])
    runs = sweep.plan(study, tmp_path / "out", tmp_path / "s")
    def callers_handler(signum, frame):
        pass
    before = signal.signal(signal.SIGTERM, callers_handler)
    try:
        threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
        with pytest.raises(KeyboardInterrupt):
            sweep.sweep(runs, [None], grace=5.0, poll=0.1)
        assert signal.getsignal(signal.SIGTERM) is callers_handler   # the sweep's handler only while it runs
    finally:
        signal.signal(signal.SIGTERM, before)
    pid = int(re.search(r"x-s0: started on the CPU \(pid (\d+)\)", capsys.readouterr().out).group(1))
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)   # stopped and reaped


def test_a_folder_a_live_process_writes_is_named_and_left_alone(tmp_path, capsys):
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = '--fix off'\n")
    write_run(tmp_path / "out", "x-s0", dict(fix="off", seed=0), None, [dict(step=40)])
    (tmp_path / "out" / "x-s0" / LOCK).write_text(str(os.getpid()))   # (another sweep's run, say)
    assert sweep.main(["s", "--studies", str(studies), "--out", str(tmp_path / "out")]) == 0
    assert f"x-s0: running, left alone: {tmp_path / 'out' / 'x-s0' / LOCK} names a live process" in \
        capsys.readouterr().out
    assert not (tmp_path / "s" / "runs" / "x-s0").exists()   # not collected while it is written


@pytest.mark.parametrize("where, said", [("plan", "stopped before any run started"),
                                         ("warm_data_cache", "stopped before any run started"),
                                         ("collect_study", "stopped while collecting, after the runs")])
def test_ctrl_c_says_what_it_stopped(tmp_path, monkeypatch, capsys, where, said):
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = '--preset tiny --fix off'\n")
    if where != "warm_data_cache":   # (a run to do: the texts are warmed before it starts)
        write_run(tmp_path / "out", "x-s0", dict(preset="tiny", fix="off", seed=0), dict(steps=100), [dict(step=100)])
    def ctrl_c(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(sweep, where, ctrl_c)
    assert sweep.main(["s", "--studies", str(studies), "--out", str(tmp_path / "out")]) == 130
    assert capsys.readouterr().err == said + (": --collect collects again" if where == "collect_study" else "") + "\n"


def test_collect_only(tmp_path, capsys):
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0, 1]\n[s.arms]\nx = '--fix off'\n")
    write_run(tmp_path / "out", "x-s0", dict(fix="off", seed=0), dict(steps=40), [dict(step=40, elapsed_s=4)])
    write_run(tmp_path / "s" / "runs", "old-s0", {}, None, [dict(step=10)])  # not the study's
    assert sweep.main(["s", "--studies", str(studies), "--out", str(tmp_path / "out"), "--collect"]) == 0
    assert "old-s0: not a run of study s" in capsys.readouterr().out
    rows = read_csv(tmp_path / "s" / "runs.csv")
    assert [(row["name"], row["steps"], row["flags"]) for row in rows] == [("x-s0", "40", "--fix off")]
    assert not (tmp_path / "out" / "x-s1").exists()  # nothing was run


def test_collect_keeps_the_rows_of_runs_without_logs(tmp_path):
    """runs.csv may hold summaries of runs whose logs were never kept: collecting keeps them (and their extra
    columns) under ARM-sSEED-nolog, so that a new run of the same arm and seed, with its log, stands beside them."""
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = '--fix off'\n")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "runs.csv").write_text("name,arm,steps,variant\nold-s3,old,999,patched\nx-s0,x,1,\n")
    write_run(tmp_path / "out", "x-s0", dict(fix="off", seed=0), dict(steps=40), [dict(step=40, elapsed_s=4)])
    for _ in range(2):   # collecting again changes nothing
        assert sweep.main(["s", "--studies", str(studies), "--out", str(tmp_path / "out"), "--collect"]) == 0
        rows = read_csv(tmp_path / "s" / "runs.csv")
        assert [(row["name"], row["steps"], row["variant"], row["log_kept"]) for row in rows] == [
            ("old-s3-nolog", "999", "patched", "False"), ("x-s0", "40", "", "True")]


def test_collect_reads_an_older_runs_csv(tmp_path):
    """A runs.csv written before fix, delta and precision took today's spellings: its rows of runs without logs
    are kept in today's spellings (their flags too), under today's columns."""
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = '--fix off'\n")
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "runs.csv").write_text(
        "name,arm,flags,fix,precision,delta_from_p,delta_fp32,stochastic_o,steps\n"
        "p-s0,p,--precision paper --fix off --delta-from-p,off,paper,True,False,off,999\n"
        "d-s0,d,--fix off,off,fa2,False,False,off,998\n")
    write_run(tmp_path / "out", "x-s0", dict(fix="off", seed=0), dict(steps=40), [dict(step=40, elapsed_s=4)])
    assert sweep.main(["s", "--studies", str(studies), "--out", str(tmp_path / "out"), "--collect"]) == 0
    with open(tmp_path / "s" / "runs.csv", newline="") as f:
        assert next(csv.reader(f)) == sweep.COLUMNS
    rows = read_csv(tmp_path / "s" / "runs.csv")
    assert [(r["name"], r["flags"], r["fix"], r["precision"], r["delta"], r["stochastic_o"], r["steps"])
            for r in rows] == [
        ("p-s0-nolog", "--precision autocast --fix off --delta p", "off", "autocast", "p", "off", "999"),
        ("d-s0-nolog", "--fix off", "off", "fa2", "o", "off", "998"),
        ("x-s0", "--fix off", "off", "fa2", "o", "off", "40")]


def test_collected_finished_run_is_not_overwritten(tmp_path):
    study = sweep.load_study(write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = ''\n"), "s")
    write_run(tmp_path / "out", "x-s0", {}, dict(steps=30), [dict(step=30)])              # restarted, unfinished
    write_run(tmp_path / "results" / "runs", "x-s0", {}, dict(steps=100), [dict(step=100)])  # finished
    (row,) = sweep.collect_study(study, tmp_path / "out", tmp_path / "results")
    assert row["steps"] == 100


def test_a_run_folder_with_a_damaged_file_is_left_out(tmp_path, capsys):
    """A config.json or summary.json that cannot be parsed (a disk that filled, a run killed as it wrote it): that
    run is left out of the plan and of runs.csv, in one line; the others go on. A copy collected before stays."""
    studies = write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0, 1, 2]\n[s.arms]\nx = '--fix off'\n")
    out, results = tmp_path / "out", tmp_path / "s"
    for seed in (0, 1, 2):
        write_run(out, f"x-s{seed}", dict(fix="off", seed=seed), dict(steps=100), [dict(step=100, elapsed_s=6)])
    write_run(results / "runs", "x-s1", dict(fix="off", seed=1), dict(steps=100), [dict(step=100, elapsed_s=9)])
    (out / "x-s1" / "summary.json").write_text('{"steps": 1')
    (out / "x-s2" / "config.json").write_text("")
    damaged = {"x-s1": f"{out / 'x-s1' / 'summary.json'} cannot be parsed as JSON (Expecting ',' delimiter: line 1 "
                       f"column 12 (char 11))",
               "x-s2": f"{out / 'x-s2' / 'config.json'} cannot be parsed as JSON (Expecting value: line 1 column 1 "
                       f"(char 0))"}
    assert sweep.main(["s", "--studies", str(studies), "--out", str(out), "--collect"]) == 0
    printed = capsys.readouterr().out.splitlines()
    for name, why in damaged.items():
        assert f"{name}: damaged, left out: {why}" in printed and f"{name}: not collected, {why}" in printed
    rows = read_csv(results / "runs.csv")
    assert [(row["name"], row["minutes"]) for row in rows] == [("x-s0", "0.1"), ("x-s1", "0.15")]   # x-s1: as kept
    assert not (results / "runs" / "x-s2").exists()

    csv_path = tmp_path / "any.csv"
    assert sweep.main(["--collect", str(out), "--csv", str(csv_path)]) == 0
    assert [row["name"] for row in read_csv(csv_path)] == ["x-s0"]
    assert [line for line in capsys.readouterr().out.splitlines() if "left out" in line] == [
        f"{out / name}: left out, {why}" for name, why in damaged.items()]


# -----------------------------------------------------------------------------
# Collecting any run folders


def diag_row(step, sn, tie):
    """A log row with diagnostics for 2 layers x 2 heads: sn[(layer, head)] and tie[layer]."""
    row = dict(step=step, elapsed_s=step * 0.6, train_loss=3.0 - step / 1000, val_loss="", tokens_per_s=1000.0)
    for i in range(2):
        row |= {f"max_logit_L{i}": 5.0 + i, f"tie_rate_L{i}": tie[i], f"tie_rate_L{i}_H1": 2 * tie[i]}
        row |= {f"sn_q_L{i}_H{h}": sn[i, h] for h in range(2)}
    return row


def test_a_log_cut_short_of_its_summary_is_not_collected(tmp_path, capsys):
    """A run whose log ends before the steps its summary.json records (a copy cut short): the copy collected before
    stays, and so does its row."""
    study = sweep.load_study(write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = ''\n"), "s")
    rows = [dict(step=step, elapsed_s=step / 10) for step in range(10, 101, 10)]
    write_run(tmp_path / "out", "x-s0", {}, dict(steps=100), rows[:4])
    log = write_run(tmp_path / "results" / "runs", "x-s0", {}, dict(steps=100), rows) / "log.csv"
    whole = log.read_text()
    (row,) = sweep.collect_study(study, tmp_path / "out", tmp_path / "results")
    assert (f"x-s0: not collected, {tmp_path / 'out' / 'x-s0' / 'log.csv'} ends at step 40, before the 100 steps "
            f"of its summary.json") in capsys.readouterr().out.splitlines()
    assert log.read_text() == whole and (row["steps"], row["minutes"]) == (100, 10 / 60)


def test_a_collected_copy_is_replaced_only_by_as_much(tmp_path, capsys):
    """A collected copy is a recorded result: a run in --out of the same name replaces it only where its log reaches
    as far (a collapse there: only with the same summary.json), and never removes it before the new copy is whole."""
    study = sweep.load_study(write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = ''\n"), "s")
    out, results = tmp_path / "out", tmp_path / "results"
    rows = [dict(step=step, elapsed_s=step / 10) for step in range(10, 101, 10)]
    kept = write_run(results / "runs", "x-s0", {}, None, rows[:8])   # unfinished, at step 80
    collected = (kept / "log.csv").read_text()
    said = lambda: [line for line in capsys.readouterr().out.splitlines() if "not collected" in line]
    for log in (rows[:3], []):   # a shorter attempt; one whose log has its header alone
        shutil.rmtree(out, ignore_errors=True)
        write_run(out, "x-s0", {}, None, log)
        (row,) = sweep.collect_study(study, out, results)
        assert row["steps"] == 80 and (kept / "log.csv").read_text() == collected
        assert said() == [f"x-s0: not collected, {out / 'x-s0'} ends at step 30, before the collected copy's 80: the "
                          f"collected copy is kept (move one of them aside to collect the other)"] if log else \
            len(said()) == 1
    (out / "x-s0" / "log.csv").write_text("")   # empty: no row, nothing to copy
    (row,) = sweep.collect_study(study, out, results)
    assert row["steps"] == 80 and len(said()) == 1 and not (results / "x-s0.collecting").exists()
    # a collapse collected: another collapse of that name is another sample, not collected over it
    shutil.rmtree(out)
    shutil.rmtree(results)
    fell = dict(steps=90, collapsed=True, collapse_step=90, collapse_minute=0.2, reason="loss spike", minutes=0.2)
    write_run(results / "runs", "x-s0", {}, fell, rows[:9])
    write_run(out, "x-s0", {}, dict(fell, steps=50, collapse_step=50), rows[:5])
    (row,) = sweep.collect_study(study, out, results)
    assert row["collapse_step"] == 90 and said() == [
        f"x-s0: not collected, {out / 'x-s0'} is not the run collected at {results / 'runs' / 'x-s0'}, which collapsed "
        f"at step 90, after 0.2 training minutes: loss spike: the collected copy is kept (move one of them aside to "
        f"collect the other)"]
    (out / "x-s0" / "summary.json").write_text(json.dumps(fell))   # the same run again: collected as it was
    write_run(out.with_name("same"), "x-s0", {}, None, rows[:9])
    shutil.copy(out.with_name("same") / "x-s0" / "log.csv", out / "x-s0" / "log.csv")
    (row,) = sweep.collect_study(study, out, results)
    assert row["collapse_step"] == 90 and said() == []


def test_a_half_written_last_line_is_not_collected(tmp_path):
    """The thinned copy of a log a run is still writing leaves out its last line, cut within a cell, as every reader
    does: else the row would read step 4 for step 40."""
    study = sweep.load_study(write_studies(tmp_path, "[s]\nmin_steps = 100\nseeds = [0]\n[s.arms]\nx = ''\n"), "s")
    log = write_run(tmp_path / "out", "x-s0", {}, None, [dict(step=10, elapsed_s=1.0), dict(step=20, elapsed_s=2.0)])
    with open(log / "log.csv", "a") as f:
        f.write("4")   # step 40 being written
    (row,) = sweep.collect_study(study, tmp_path / "out", tmp_path / "results")
    assert row["steps"] == 20


def test_collect_into_a_table_keeps_its_columns(tmp_path):
    """--collect DIR --csv FILE keeps the columns FILE has that no run folder tells (late_stage's forked_from), each
    run's cell with it."""
    runs, table = tmp_path / "runs", tmp_path / "runs.csv"
    write_run(runs, "x-s0", {}, dict(steps=10), [dict(step=10)])
    assert sweep.main(["--collect", str(runs), "--csv", str(table)]) == 0
    rows = read_csv(table)
    write_csv(table, [dict(rows[0], forked_from="base@5")], list(rows[0]) + ["forked_from"])
    assert sweep.main(["--collect", str(runs), "--csv", str(table)]) == 0
    assert [(row["name"], row["forked_from"]) for row in read_csv(table)] == [("x-s0", "base@5")]


def test_collect_into_a_table_keeps_its_rows(tmp_path, capsys):
    """--collect DIR --csv FILE rewrites FILE only if every run it has a row of is in the folders: a study's
    runs.csv keeps rows of runs whose logs are gone, which this mode would otherwise lose."""
    runs, table = tmp_path / "runs", tmp_path / "runs.csv"
    write_run(runs, "x-s0", {}, dict(steps=10), [dict(step=10)])
    assert sweep.main(["--collect", str(runs), "--csv", str(table)]) == 0
    assert sweep.main(["--collect", str(runs), "--csv", str(table)]) == 0   # the same runs again: rewritten
    table.write_text(table.read_text() + "x-s1-nolog" + "," * (len(read_csv(table)[0]) - 1) + "\n")
    kept = table.read_text()
    with pytest.raises(SystemExit) as exited:
        sweep.main(["--collect", str(runs), "--csv", str(table)])
    assert exited.value.code == 2 and capsys.readouterr().err.endswith(
        f"{table} has rows of 1 runs these folders do not hold (x-s1-nolog): not rewritten; give a new file, or "
        f"every folder (a study's runs.csv: python -m experiments.sweep STUDY --collect)\n")
    assert table.read_text() == kept
    with pytest.raises(SystemExit) as exited:   # a folder that cannot be written: one line
        sweep.main(["--collect", str(runs), "--csv", str(tmp_path / "runs.csv" / "x.csv")])
    assert exited.value.code == 2 and capsys.readouterr().err.endswith(f": error: File exists: {table}\n")


def test_collect_refuses_no_runs_and_a_csv_that_is_a_folder(tmp_path, capsys):
    nowhere, runs, csv_path = tmp_path / "nowhere", tmp_path / "runs", tmp_path / "any.csv"
    write_run(runs, "x-s0", {}, dict(steps=10), [dict(step=10)])
    for argv, error in (
            ([str(nowhere), "--csv", str(csv_path)],
             f"no readable run folders (with a log.csv or log.csv.gz) in {nowhere}; {csv_path} not written"),
            ([str(runs), "--csv", str(tmp_path)], f"--csv must be a file: {tmp_path} is a folder")):
        with pytest.raises(SystemExit) as exited:
            sweep.main(["--collect", *argv])
        assert exited.value.code == 2 and capsys.readouterr().err.endswith(f": error: {error}\n")
    assert not csv_path.exists()


def test_collect_synthetic_runs(tmp_path):
    base = {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 1.5, (1, 1): 0.5}
    config = dict(preset="test", attn="kernel", precision="fa2", fix="off", seed=3, lr=1e-3, batch_size=8,
                  block_size=32, n_layer=2, n_head=2, n_embd=16, steps=100, mantissa_bits=3, delta="p",
                  stochastic_o="forward")
    rows = [dict(step=10, elapsed_s=6.0, train_loss=3.0, val_loss="", tokens_per_s=900.0),  # no diagnostics
            diag_row(20, base, (0.01, 0.02)),                                            # the baseline
            diag_row(40, base | {(1, 1): 1.45, (0, 1): 5.8}, (0.05, 0.01)),             # 2.9x, 2.9x: not yet
            diag_row(60, base | {(1, 1): 1.6, (0, 0): 3.5}, (0.03, 0.20)),              # 3.2x and 3.5x: (0, 0)
            dict(step=70, elapsed_s=42.0, train_loss=2.9, val_loss=2.95, tokens_per_s=1100.0)]  # no diagnostics
    summary = dict(collapsed=True, collapse_step=60, collapse_minute=0.6, reason="loss spike", steps=70,
                   minutes=0.7, final_val_loss=2.95, final_train_loss=2.9, max_logit=6.0, tokens_per_s=1000.0,
                   peak_mem_gb=None, name="arm-s3", seed=3, attn="kernel", precision="fa2", fix="off")
    write_run(tmp_path / "runs", "arm-s3", config, summary, rows)
    # an old run: no summary.json, no delta/mantissa_bits/stochastic_o in its config, no head ever grows
    old = {k: v for k, v in config.items() if k not in ("delta", "mantissa_bits", "stochastic_o")}
    write_run(tmp_path / "old", "legacy", dict(old, seed=0), None, rows[:3])
    # a run of the older spellings: delta as delta_from_p / delta_fp32, precision "paper"
    older = dict(old, seed=1, precision="paper", delta_from_p=True, delta_fp32=False, stochastic_o="off")
    write_run(tmp_path / "old", "older", older, None, rows[:3])

    sweep.main(["--collect", str(tmp_path / "runs"), str(tmp_path / "old" / "legacy"),
                str(tmp_path / "old" / "older"), "--csv", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        assert next(csv.reader(f)) == sweep.COLUMNS
    table = {row["name"]: row for row in read_csv(tmp_path / "out.csv")}
    assert list(table) == ["arm-s3", "legacy", "older"]
    a, b, c = table["arm-s3"], table["legacy"], table["older"]
    assert (c["precision"], c["delta"], c["stochastic_o"]) == ("autocast", "p", "off")
    assert (a["arm"], a["seed"], a["mantissa_bits"], a["delta"], a["stochastic_o"]) == ("arm", "3", "3", "p", "forward")
    # its flags: what sets it apart from its preset (a preset train.py lacks: from the default), as analyze names it
    assert a["flags"] == "--preset test --fix off --delta p --stochastic-o forward --mantissa-bits 3 --n-layer 2 " \
                         "--n-head 2 --n-embd 16 --block-size 32 --batch-size 8"
    assert sweep.contradiction(tmp_path / "runs" / "arm-s3", shlex.split(a["flags"])) == ""
    assert (a["collapsed"], a["collapse_step"], a["steps"], a["max_logit"]) == ("True", "60", "70", "6.0")
    assert float(a["tie_rate_final"]) == 0.2  # max over layers of each layer's last value (0.03, 0.20)
    assert float(a["tie_rate_head_peak"]) == 0.4  # max over heads and steps (layer 1, head 1, step 60)
    # the baseline is step 20 (the first row past a quarter of 70 steps); both (0, 0) (3.5x) and (1, 1) (3.2x)
    # first pass 3x at step 60: the larger ratio wins
    assert (a["first_growth_layer"], a["first_growth_head"], a["first_growth_step"]) == ("0", "0", "60")
    assert (b["arm"], b["delta"], b["mantissa_bits"], b["stochastic_o"], b["collapsed"]) == (
        "legacy", "o", "0", "off", "")
    assert (b["steps"], float(b["minutes"]), b["max_logit"]) == ("40", 0.4, "6.0")  # from the log
    assert float(b["tie_rate_final"]) == 0.05
    assert b["first_growth_layer"] == b["first_growth_head"] == b["final_val_loss"] == ""


@pytest.mark.parametrize("argv, error", [
    (["--collect", "x"], "takes --csv"),
    (["s", "--collect", "x", "--csv", "y.csv"], "no study"),
    (["s", "--csv", "y.csv"], "--csv goes with --collect"),
    ([], "name a study"),
    *((["s", "--minutes", minutes], "--minutes must be a positive number") for minutes in ("-1", "0", "nan")),
])
def test_command_line_errors(argv, error, capsys):
    with pytest.raises(SystemExit):
        sweep.main(argv)
    assert error in capsys.readouterr().err


# -----------------------------------------------------------------------------
# The real train.py


def test_every_declared_run_is_a_command_train_py_takes():
    """Each run of every study in results/studies.toml passes train.py's parser (sweep.check_flags)."""
    names = tomllib.loads(sweep.STUDIES.read_text())
    for name in names:
        study = sweep.load_study(sweep.STUDIES, name)
        sweep.check_flags([dict(run, state="new") for run in study.runs("out", "results")])


@pytest.mark.parametrize("flags, error", [
    ("--fix of", "bad-s0: train.py: error: argument --fix: invalid choice: 'of'"),
    ("--fixx off", "bad-s0: train.py: error: unrecognized arguments: --fixx off"),
    ("--att sdpa", "bad-s0: train.py: error: unrecognized arguments: --att sdpa"),   # a prefix: train.py's in full
    ("--fix on --attn sdpa", "bad-s0: train.py: error: --fix on: only our kernel has it"),   # a setting's check
    ("--lr 0", "bad-s0: train.py: error: --lr must be a positive, finite number"),
    ("--help", "bad-s0: --help prints train.py's flags, it starts no run"),
])
@pytest.mark.parametrize("preset", ["tiny", "default"])   # default: sized for a GPU, on a machine without one
def test_a_flag_train_py_refuses_stops_the_study_before_any_run(tmp_path, text, gpus, capsys, flags, error, preset):
    gpus(0)
    studies = write_studies(tmp_path, f"""
        [tiny]
        min_steps = 20
        seeds = [0]
        common = "--preset {preset} --data {text}"
        [tiny.arms]
        good = "--fix off"
        bad = "{flags}"
    """)
    with pytest.raises(SystemExit) as exit:
        sweep.main(["tiny", "--studies", str(studies), "--out", str(tmp_path / "out")])
    assert exit.value.code == 2 and error in capsys.readouterr().err
    assert not (tmp_path / "out").exists()   # not even the good arm started


def test_tiny_study_on_cpu(tmp_path, text, gpus):
    gpus(0)
    studies = write_studies(tmp_path, f"""
        [tiny]
        min_steps = 20
        seeds = [1]
        common = "--preset tiny --batch-size 8 --block-size 32 --data {text}"
        [tiny.arms]
        sdpa = "--attn sdpa"
    """)
    assert sweep.main(["tiny", "--studies", str(studies), "--out", str(tmp_path / "out")]) == 0
    (row,) = read_csv(tmp_path / "tiny" / "runs.csv")
    assert (row["name"], row["arm"], row["seed"], row["attn"], row["steps"], row["collapsed"]) == (
        "sdpa-s1", "sdpa", "1", "sdpa", "20", "False")
    assert row["final_val_loss"] and row["tie_rate_final"]
    assert "--seed 1" in (tmp_path / "out" / "sdpa-s1" / "stdout.log").read_text()
    assert load_run(tmp_path / "tiny" / "runs" / "sdpa-s1").outcome["steps"] == 20


# -----------------------------------------------------------------------------
# The committed studies: each runs.csv row of a kept run folder is what collecting that folder gives now


def committed_rows():
    """The committed rows as the code reads them: in today's spellings (nanolp.runconfig.as_current)."""
    for table in sorted(sweep.ROOT.glob("results/*/runs.csv")):
        for row in read_csv(table):
            yield table.parent, as_current(row)


def test_every_committed_run_folder_has_its_row():
    folders = sorted(sweep.ROOT.glob("results/*/runs/*/summary.json"))
    assert folders, "no committed run folders found"
    rows = {(study, row["name"]) for study, row in committed_rows()}
    for summary in folders:
        assert (summary.parents[2], summary.parent.name) in rows, f"{summary.parent} has no row in runs.csv"


def test_committed_rows_equal_their_run_folders():
    """Rebuilds the row of every kept run folder from its summary.json and log and compares it with runs.csv,
    cell by cell: a row's settings and outcome are its summary's, and its flags (never blank) its config's and, where
    studies.toml declares its arm, that arm's."""
    toml = sweep.ROOT / "results/studies.toml"
    studies = {name: sweep.load_study(toml, name) for name in tomllib.loads(toml.read_text())}
    checked = 0
    for study, row in committed_rows():
        folder = study / "runs" / row["name"]
        if row.get("log_kept") != "True":
            assert not folder.exists() and row["name"].endswith(sweep.NO_LOG), row["name"]
            continue
        flags = shlex.split(row["flags"] or "")   # (given to collect_row below: checked here against the run's config)
        assert flags and sweep.contradiction(folder, flags) == "", (folder, sweep.contradiction(folder, flags))
        declared = studies.get(study.name)
        if declared and row["arm"] in declared.arms:   # a declared arm's row holds that arm's flags
            assert flags == [*declared.common, *declared.arms[row["arm"]][0]], (folder, flags)
        rebuilt = sweep.collect_row(load_run(folder), row["arm"], row["flags"])
        rebuilt = {k: str(cell(v)) for k, v in rebuilt.items()}
        assert list(rebuilt) == sweep.COLUMNS   # (every column is a cell of the run's, none left blank by omission)
        assert {k: str(cell(row[k])) for k in rebuilt} == rebuilt, folder   # (a cell an older table lacks: as_current's)
        summary = json.loads((folder / "summary.json").read_text())
        for key in ("fix", "attn", "seed", "collapsed", "steps"):
            assert row[key] == str(summary[key]), (folder, key)
        checked += 1
    assert checked == sum(row.get("log_kept") == "True" for _, row in committed_rows()) > 0


def test_a_kept_run_not_collected_keeps_its_row(tmp_path):
    """A row whose run folder still holds its log (not collected this time: a damaged file, or an arm no longer
    declared) is written back as it was, not renamed -nolog: collected again later, it is not counted twice."""
    table = tmp_path / "runs.csv"
    table.write_text("name,arm,flags,seed,log_kept\noff-s0,off,--fix off,0,True\noff-s1,off,--fix off,1,True\n")
    (tmp_path / "runs" / "off-s0").mkdir(parents=True)
    (tmp_path / "runs" / "off-s0" / "log.csv.gz").write_bytes(b"")
    rows, _ = sweep.kept_rows(table, set(), tmp_path / "runs")
    assert [(row["name"], row["log_kept"]) for row in rows] == [("off-s0", "True"), ("off-s1-nolog", False)]


def test_collect_refuses_a_runs_csv_cut_short(tmp_path, capsys):
    """An existing runs.csv whose last row is cut short, or that names no run, is named in one line and left as it
    was: its rows would be written back with their cells empty."""
    table = tmp_path / "results" / "runs.csv"
    table.parent.mkdir()
    table.write_text("name,arm,flags,seed\noff-s0-nolog,off,--fix off,0\noff-s1-nolog,off,--fix")
    before = table.read_bytes()
    with pytest.raises(sweep.StudyError, match=re.escape(f"{table}") + ".*line 3.*not rewritten"):
        sweep.kept_rows(table, set(), tmp_path / "runs")
    assert table.read_bytes() == before
    table.write_text("arm,flags,seed\noff,--fix off,0\n")   # whole rows, but no run's name
    with pytest.raises(sweep.StudyError, match=re.escape(f"{table} is not a study's runs.csv: no column name; not "
                                                         "rewritten")):
        sweep.kept_rows(table, set(), tmp_path / "runs")
