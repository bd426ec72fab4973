"""experiments/onset.py: the late-stage row read from a log, one clear line for bad input, and the committed tables
equal to what their runs' logs give."""

import csv
import json
from pathlib import Path

import pytest

from experiments import onset


def write_run(tmp_path, logits, collapse_step):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "max_logit_L0"])
        w.writerows([(1000 * (i + 1), v) for i, v in enumerate(logits)])
    (run / "summary.json").write_text(json.dumps({"collapse_step": collapse_step}))
    return run


def test_late_counts_steps_from_1e3_to_1e6_and_to_the_collapse(tmp_path):
    run = write_run(tmp_path, [10, 500, 2e3, 5e5, 3e6, 4e8], collapse_step=5500)
    row = onset.late(run)
    assert ">1e3 at 3000  >1e6 at 5000  1e3->1e6 2,000  collapse 5500  1e6->collapse 500" in row
    assert "last 4.0e+08  largest 4.0e+08" in row


def test_growth_reads_step_10000_the_end_and_the_largest(tmp_path):
    """Layer 0's columns at step 10,000, at the last row and at their largest; the gains only where logged."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "max_logit_L0", "sn_q_L0", "sn_k_L0", "gain_q_L0", "gain_k_L0", "val_loss"])
        w.writerow([5000, 9, 1, 1, 1.0, 1.0, 3.0])
        w.writerow([10000, 10, 2, 3, 1.5, 1.25, ""])   # a row without a diagnostic is skipped:
        w.writerow([12000, "", "", "", "", "", 2.0])
        w.writerow([15000, 30, 8, 3, 2.5, 1.0, ""])
        w.writerow([20000, 20, 4, 6, 2.0, 1.5, ""])
    assert onset.growth(run) == ("run              step 10,000 -> 20,000: max_logit_L0 10 -> 20 (largest 30), sn_q_L0 "
                                 "2 -> 4 (largest 8), sn_k_L0 3 -> 6 (largest 6), gain_q_L0 1.5 -> 2 (largest 2.5), "
                                 "gain_k_L0 1.25 -> 1.5 (largest 1.5)")
    (run / "log.csv").write_text("step,max_logit_L0,sn_q_L0,sn_k_L0\n10000,10,2,3\n20000,20,4,6\n")
    assert onset.growth(run).endswith("sn_k_L0 3 -> 6 (largest 6)")
    (run / "log.csv").write_text("step,max_logit_L0,sn_q_L0,sn_k_L0\n5000,10,2,3\n")   # stopped before step 10,000
    assert onset.growth(run) == "run              no diagnostic row at step 10,000"


def test_heads_reads_as_many_heads_as_the_run_logged(tmp_path):
    """The lead head of a run with two heads (the default has six): the one whose W_Q norm grew most by take-off."""
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "log.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "max_logit_L0"] + [f"{c}_L0_H{h}" for c in ("sn_q", "tie_rate") for h in (0, 1)])
        w.writerows([[2000, 5, 1, 1, 0.5, 0.25], [3000, 50, 2, 1.5, 0.5, 0.25], [6000, 150, 3, 9, 0.5, 0.25]])
    assert onset.heads(run) == (
        "run              at take-off (step 6,000): lead head 1, W_Q norm x6.0 over step 3,000 (the other heads "
        "x1.5-1.5); at 3,000 its norm 1.5, rank 2 (largest 2.0); tie rate 2k-8k 0.2500, rank 2 (largest 0.5000)")
    with open(run / "log.csv", "w", newline="") as f:   # a take-off before step 2,000 (lr 1e-2): no reference
        w = csv.writer(f)
        w.writerow(["step", "max_logit_L0", "sn_q_L0_H0", "tie_rate_L0_H0"])
        w.writerows([[500, 5, 1, 0.5], [1000, 150, 3, 0.5]])
    assert onset.heads(run) == "run              no reference step before its take-off at 1,000"
    (run / "log.csv").write_text("step,max_logit_L0\n500,\n")
    assert onset.late(run) == "run              no diagnostic rows"


@pytest.mark.parametrize("argv, message", [
    ([], "usage: python -m experiments.onset"),
    (["--late"], "usage: python -m experiments.onset"),
    (["--help"], "usage: python -m experiments.onset"),
    (["--late", "no-such-run"], "onset: no log.csv or log.csv.gz in no-such-run"),
])
def test_bad_input_is_one_line(argv, message):
    with pytest.raises(SystemExit) as exit:
        onset.main(argv)
    assert str(exit.value).startswith(message)


RESULTS = Path(onset.__file__).resolve().parent.parent / "results"
TABLES = {"onset.txt": onset.onset, "lead_heads.txt": onset.heads, "late_stage.txt": onset.late,
          "growth.txt": onset.growth}


@pytest.mark.parametrize("table", [p.relative_to(RESULTS).as_posix() for name in TABLES
                                   for p in sorted(RESULTS.glob(f"*/{name}")) if (p.parent / "runs").is_dir()])
def test_committed_rows_are_their_runs_logs(table):
    """Each row of a committed table whose run keeps its log under the study's runs/ is what that log gives now: a
    run replaced by a rerun of the same name shows here. Rows of runs whose logs were not kept are left as they are;
    onset.txt and lead_heads.txt have a row for every kept run (late_stage.txt only for runs past 1e3)."""
    path = RESULTS / table
    rows = {line.split()[0]: line.rstrip() for line in path.read_text().splitlines() if line.strip()}
    kept = [run for run in sorted((path.parent / "runs").glob("*")) if onset.log_path(run).exists()]
    assert kept
    for run in kept:
        if run.name in rows:
            assert rows[run.name] == TABLES[path.name](run), run
        else:
            assert path.name == "late_stage.txt", f"{table} has no row for {run.name}"
            assert all(float(r["max_logit_L0"]) <= 1e3 for r in onset.log_rows(run) if r.get("max_logit_L0")), run
