"""nanolp/sweep.py: collecting synthetic run folders into a CSV, deciding what each run needs, and one tiny
real sweep on the CPU (two train.py processes side by side), which a second invocation skips."""
import csv
import json
import random
import shutil

import pytest

from nanolp import data, sweep


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


def diag_row(step, sn, tie):
    """A log row with diagnostics for 2 layers x 2 heads: sn[(layer, head)] and tie[layer]."""
    row = dict(step=step, elapsed_s=step * 0.6, train_loss=3.0 - step / 1000, val_loss="", tokens_per_s=1000.0)
    for i in range(2):
        row |= {f"max_logit_L{i}": 5.0 + i, f"tie_rate_L{i}": tie[i], f"tie_rate_L{i}_H1": 2 * tie[i]}
        row |= {f"sn_q_L{i}_H{h}": sn[i, h] for h in range(2)}
    return row


def read_csv(path):
    with open(path, newline="") as f:
        return {row["name"]: row for row in csv.DictReader(f)}


def test_collect_synthetic_runs(tmp_path):
    base = {(0, 0): 1.0, (0, 1): 2.0, (1, 0): 1.5, (1, 1): 0.5}
    config = dict(preset="test", attn="kernel", precision="fa2", fix="off", seed=3, lr=1e-3, batch_size=8,
                  block_size=32, n_layer=2, n_head=2, n_embd=16, steps=100, mantissa_bits=3, delta_from_p=True)
    rows = [dict(step=10, elapsed_s=6.0, train_loss=3.0, val_loss="", tokens_per_s=900.0),  # no diagnostics
            diag_row(20, base, (0.01, 0.02)),                                            # the baseline
            diag_row(40, base | {(1, 1): 1.45, (0, 1): 5.8}, (0.05, 0.01)),             # 2.9x, 2.9x: not yet
            diag_row(60, base | {(1, 1): 1.6, (0, 0): 3.5}, (0.03, 0.20)),              # 3.2x and 3.5x: (0, 0)
            dict(step=70, elapsed_s=42.0, train_loss=2.9, val_loss=2.95, tokens_per_s=1100.0)]  # no diagnostics
    summary = dict(collapsed=True, collapse_step=60, collapse_minute=0.6, reason="loss spike", steps=70,
                   minutes=0.7, final_val_loss=2.95, final_train_loss=2.9, max_logit=6.0, tokens_per_s=1000.0,
                   peak_mem_gb=None, name="arm-s3", seed=3, attn="kernel", precision="fa2", fix="off")
    write_run(tmp_path / "runs", "arm-s3", config, summary, rows)
    # an old run: no summary.json, no delta_from_p/mantissa_bits in its config, no head ever doubles
    old = {k: v for k, v in config.items() if k not in ("delta_from_p", "mantissa_bits")}
    write_run(tmp_path / "old", "legacy", dict(old, seed=0), None, rows[:3])

    sweep.main(["--collect", str(tmp_path / "runs"), str(tmp_path / "old" / "legacy"),
                "--csv", str(tmp_path / "out.csv")])
    with open(tmp_path / "out.csv", newline="") as f:
        assert next(csv.reader(f)) == sweep.COLUMNS
    table = read_csv(tmp_path / "out.csv")
    assert list(table) == ["arm-s3", "legacy"]
    a, b = table["arm-s3"], table["legacy"]
    assert (a["arm"], a["seed"], a["mantissa_bits"], a["delta_from_p"]) == ("arm", "3", "3", "True")
    assert (a["collapsed"], a["collapse_step"], a["steps"], a["max_logit"]) == ("True", "60", "70", "6.0")
    assert float(a["tie_rate_final"]) == 0.2  # max over layers of each layer's last value (0.03, 0.20)
    assert float(a["tie_rate_head_peak"]) == 0.4  # max over heads and steps (layer 1, head 1, step 60)
    # the baseline is step 20 (the first row past a quarter of 70 steps); both (0, 0) (3.5x) and (1, 1) (3.2x)
    # first pass 3x at step 60: the larger ratio wins
    assert (a["first_growth_layer"], a["first_growth_head"], a["first_growth_step"]) == ("0", "0", "60")
    assert (b["arm"], b["delta_from_p"], b["mantissa_bits"], b["collapsed"]) == ("legacy", "False", "0", "")
    assert (b["steps"], float(b["minutes"]), b["max_logit"]) == ("40", 0.4, "6.0")  # from the log
    assert float(b["tie_rate_final"]) == 0.05
    assert b["first_growth_layer"] == b["first_growth_head"] == b["final_val_loss"] == ""


def test_run_state_and_resume_minutes(tmp_path):
    config = dict(steps=100)
    rows = [dict(step=s, elapsed_s=s * 1.2) for s in (10, 20, 30)]
    assert sweep.run_state(tmp_path / "missing") == "new"
    done = write_run(tmp_path, "done", config, dict(steps=100, collapsed=False), rows)
    assert sweep.run_state(done) == "finished"
    assert sweep.run_state(done, target_steps=200) == "stale"  # a longer target, but nothing to resume from
    crashed = write_run(tmp_path, "crashed", config, dict(steps=30, collapsed=True), rows)
    assert sweep.run_state(crashed, target_steps=200) == "finished"
    cut = write_run(tmp_path, "cut", config, dict(steps=30, collapsed=False), rows)  # stopped by --minutes
    (cut / "ckpt").mkdir()
    for step in (10, 20):
        (cut / "ckpt" / f"step_{step:07d}.pt").write_bytes(b"")
    assert sweep.run_state(cut) == "resumable"
    assert sweep.trained_minutes(cut) == pytest.approx(24 / 60)  # elapsed_s at the step-20 checkpoint
    cmd = sweep.train_command(dict(dir=cut, seed=1, state="resumable"), ["--steps", "100"], 10.0, 0.5)
    assert cmd[1:] == [str(sweep.TRAIN), "--steps", "100", "--out", str(tmp_path), "--name", "cut", "--seed", "1",
                       "--resume", "--minutes", f"{24 / 60 + 9.5:.3f}"]


def test_arm_flags():
    assert sweep.parse_arm("b3=--mantissa-bits 3 --fix off") == ("b3", ["--mantissa-bits", "3", "--fix", "off"])
    with pytest.raises(Exception, match="set by the sweep"):
        sweep.parse_arm("a=--seed 3")
    assert sweep.flag_value(["--steps", "5", "--lr", "1", "--steps=7"], "--steps") == "7"


@pytest.fixture
def text(tmp_path):
    """A small text for train.py. The subprocesses cache its tokens under the repository's data/, removed after."""
    rng = random.Random(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "good", "night", "sweet"]
    path = tmp_path / "sweep_test_words.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(4000)) + "\n")
    yield path
    shutil.rmtree(data.DATA_DIR / path.stem, ignore_errors=True)


def test_tiny_sweep_on_cpu(tmp_path, text, capsys):
    out = tmp_path / "sweep"
    argv = ["--arm", "tiny=--preset tiny --attn sdpa --batch-size 8 --block-size 32 --device cpu",
            "--seeds", "0", "1", "--steps", "20", "--data", str(text), "--out", str(out), "--minutes", "5",
            "--min-minutes", "0.1"]
    assert sweep.main(argv) == 0
    table = read_csv(out / "summary.csv")
    assert sorted(table) == ["tiny-s0", "tiny-s1"]
    for seed in (0, 1):
        row = table[f"tiny-s{seed}"]
        assert (row["arm"], row["seed"], row["steps"], row["collapsed"]) == ("tiny", str(seed), "20", "False")
        assert row["final_val_loss"] and row["tie_rate_final"]
        assert "--seed" in (out / f"tiny-s{seed}" / "stdout.log").read_text()
    assert table["tiny-s0"]["final_train_loss"] != table["tiny-s1"]["final_train_loss"]  # different seeds
    capsys.readouterr()
    assert sweep.main(argv) == 0  # again: both are finished, nothing runs
    printed = capsys.readouterr().out
    assert "tiny-s0: finished" in printed and "tiny-s1: finished" in printed and "started" not in printed
    assert len(read_csv(out / "summary.csv")) == 2
