"""train.py end to end on the CPU: a tiny run learns and writes its run folder; --resume continues a run
exactly; a non-finite loss stops the run cleanly and keeps the last good checkpoint."""
import csv
import json
import random

import pytest
import torch

import train
from nanolp import data
from nanolp.diagnostics import diag_columns

SUMMARY_KEYS = {"collapsed", "collapse_step", "collapse_minute", "reason", "steps", "minutes", "final_val_loss",
                "final_train_loss", "max_logit", "tokens_per_s", "mfu", "peak_mem_gb", "name", "fix", "attn",
                "precision", "seed", "preset"}
TIMING = {"elapsed_s", "tokens_per_s", "mfu"}  # the only columns allowed to differ between identical runs


@pytest.fixture
def run(tmp_path, monkeypatch):
    """run(name, *flags) trains the tiny preset on a small made-up text, returns the run folder."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "good", "night", "sweet"]
    text = tmp_path / "words.txt"
    text.write_text(" ".join(rng.choice(words) for _ in range(8000)) + "\n")
    monkeypatch.setattr(data, "DATA_DIR", tmp_path / "data")  # keep the token cache out of the repository

    def run(name, *flags):
        train.main(["--preset", "tiny", "--attn", "sdpa", "--device", "cpu", "--data", str(text),
                    "--out", str(tmp_path / "runs"),
                    "--name", name, "--batch-size", "8", "--block-size", "32", "--log-interval", "10",
                    "--eval-interval", "20", "--diag-interval", "20", "--ckpt-interval", "20", *flags])
        return tmp_path / "runs" / name
    return run


def read_log(run_dir):
    with open(run_dir / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_smoke_run_learns_and_writes_its_folder(run):
    run_dir = run("smoke", "--steps", "60")
    rows = read_log(run_dir)
    assert list(rows[0]) == train.BASE_COLUMNS + diag_columns(2, 2)
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40, 50, 60]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]) - 0.5
    assert all(r["val_loss"] and r["max_logit_L1"] and r["delta_err_L0_H1"] for r in rows if int(r["step"]) % 20 == 0)
    assert not rows[0]["val_loss"] and not rows[0]["sn_q_L0"]  # only every --eval/--diag-interval steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["collapsed"] is False and summary["steps"] == 60 and summary["tokens_per_s"] > 0
    assert summary["final_val_loss"] == pytest.approx(float(rows[-1]["val_loss"]))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["preset"] == "tiny" and config["n_embd"] == 64 and config["batch_size"] == 8
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == ["step_0000020.pt", "step_0000040.pt",
                                                                     "step_0000060.pt"]


def test_delta_fp32_flag_reaches_the_config(run):
    run_dir = run("dfp32", "--attn", "emulate", "--delta-fp32", "--steps", "20")
    config = json.loads((run_dir / "config.json").read_text())
    assert config["delta_fp32"] is True and config["delta_from_p"] is False
    assert float(read_log(run_dir)[-1]["train_loss"]) < 4.0   # it trains


def test_resume_reproduces_an_uninterrupted_run(run):
    whole = run("whole", "--steps", "40")
    part = run("part", "--steps", "30")
    assert (part / "ckpt" / "step_0000030.pt").exists()  # a run saves its last step too, to resume from there
    with pytest.raises(FileExistsError, match="--resume"):
        run("part", "--steps", "30")
    run("part", "--steps", "40", "--resume")
    # the same log, except that the first leg also evaluated and diagnosed its last step, 30
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]
    first_leg_end = lambda rows: [{k: v for k, v in r.items() if r["step"] != "30" or k == "train_loss"} for r in rows]
    assert first_leg_end(strip(read_log(part))) == first_leg_end(strip(read_log(whole)))
    assert read_log(part)[2]["val_loss"] and not read_log(whole)[2]["val_loss"]
    # a run killed after step 30 but before its next checkpoint: resuming from step 20 rewrites row 30
    killed = run("killed", "--steps", "30")
    (killed / "ckpt" / "step_0000030.pt").unlink()
    run("killed", "--steps", "40", "--resume")
    assert strip(read_log(killed)) == strip(read_log(whole))
    a, b, c = (torch.load(d / "ckpt" / "step_0000040.pt") for d in (whole, part, killed))
    assert all(torch.equal(a["model"][k], b["model"][k]) and torch.equal(a["model"][k], c["model"][k])
               for k in a["model"])  # bitwise
    assert torch.equal(a["state"]["ema"], b["state"]["ema"]) and torch.equal(a["state"]["ema"], c["state"]["ema"])


def test_nan_stops_cleanly_and_keeps_last_good_checkpoint(run, monkeypatch, capsys):
    monkeypatch.setenv("NANOLP_NAN_AT_STEP", "25")  # train.py's test hook: poison the loss of step 25
    run_dir = run("nan", "--steps", "60", "--ckpt-interval", "10")
    assert "non-finite loss at step 25" in "".join(capsys.readouterr())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["collapsed"] is True and summary["collapse_step"] == 25 and "step 25" in summary["reason"]
    assert summary["steps"] == 30 and summary["final_train_loss"] is None
    ckpts = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    assert ckpts == ["step_0000010.pt", "step_0000020.pt"]  # none from the poisoned weights
    last = torch.load(run_dir / "ckpt" / ckpts[-1])
    assert all(torch.isfinite(t).all() for t in last["model"].values())


def test_loss_spike_criterion():
    state = {"ema": torch.tensor(2.0), "loss_min": float("inf")}
    c = {"warmup": 100}
    assert train.loss_spike(state, 50, c) is None and state["loss_min"] == float("inf")  # warmup: not tracked
    assert train.loss_spike(state, 150, c) is None and state["loss_min"] == 2.0
    state["ema"] = torch.tensor(2.9)
    assert train.loss_spike(state, 160, c) is None  # within SPIKE_NATS of the minimum
    state["ema"] = torch.tensor(3.1)
    assert "1.10 nats above its minimum 2.00" in train.loss_spike(state, 170, c)


def test_minutes_budget_stops_the_run(run):
    summary = json.loads((run("budget", "--steps", "1000", "--minutes", "1e-6") / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["final_val_loss"] is not None  # the last row is evaluated


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_train_and_resume(run):
    """The GPU default: our kernel under torch.compile's CUDA graphs, which reuse their output buffers every
    step (a loss kept from an earlier step would be overwritten: train.py copies what it keeps)."""
    flags = ("--device", "cuda", "--attn", "kernel", "--compile", "reduce-overhead")
    run_dir = run("graphs", *flags, "--steps", "40")
    run("graphs", *flags, "--steps", "60", "--resume")
    rows = read_log(run_dir)
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40, 50, 60]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]) - 0.5 and rows[-1]["val_loss"]
