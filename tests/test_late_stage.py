"""experiments/late_stage.py on the CPU: a fork of a run's checkpoint continues it exactly (the arm that keeps the
base's settings repeats the base's losses bit for bit), and an arm with another setting runs with it."""
import csv

import pytest

import train
from experiments import late_stage
from nanolp.runconfig import read_json
from tests.test_train import text  # noqa: F401  (the fixture)


def losses(run_dir):
    with open(run_dir / "log.csv", newline="") as f:
        return {int(row["step"]): row["train_loss"] for row in csv.DictReader(f)}


def test_fork_continues_the_checkpoint_with_the_arms_setting(tmp_path, text):  # noqa: F811
    common = ["--device", "cpu", "--out", str(tmp_path), "--steps", "30"]
    train.main(["--preset", "tiny", "--data", str(text), "--name", "base", "--batch-size", "4", "--block-size",
                "16", "--log-interval", "10", "--eval-interval", "10", "--diag-interval", "10", "--ckpt-interval",
                "10", *common])
    base = tmp_path / "base"
    assert late_stage.fork_step(base, float("inf")) is None
    step = late_stage.fork_step(base, 0.0)
    assert step == 10
    arms = {"same": {}, "torch": {"exponent": "torch"}, "fix-on": {"fix": "on"}}
    for arm, settings in arms.items():
        late_stage.fork(base, step, arm, settings)
        assert sorted(losses(tmp_path / arm)) == [10]                  # the log up to the fork, no further
        summary = train.main(["--resume", "--name", arm, *common])
        assert {k: summary[k] for k in settings} == settings and summary["steps"] == 30
        assert read_json(tmp_path / arm / "config.json")["forked_from"] == "base@10"
    assert losses(tmp_path / "same") == losses(base)                   # the fork repeats the base bit for bit
    # the two exponents differ by an ulp now and then, which this small a run may never carry into a loss; the
    # complete fix changes every row's delta, so its arm shows that a fork trains with its own setting
    assert losses(tmp_path / "fix-on")[10] == losses(base)[10] and losses(tmp_path / "fix-on") != losses(base)


def test_collect_names_a_missing_arm(tmp_path):
    with pytest.raises(SystemExit) as exited:
        late_stage.main(["--collect", str(tmp_path), "--results", str(tmp_path / "results")])
    assert str(exited.value).startswith(f"late_stage: no finished arm at {tmp_path / 'fma'}")
    assert not (tmp_path / "results").exists()
