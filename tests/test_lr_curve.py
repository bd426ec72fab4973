"""experiments/lr_curve.py: which runs are the curve's points, layer 0's step past 100, and the committed curve
regenerated from its studies' files."""
import shutil
from pathlib import Path

import numpy as np
import pytest

from experiments import lr_curve
from nanolp.runs import Run, read_table


def test_a_rows_arm_is_its_flags_less_the_lr_in_any_order_and_spelling():
    assert lr_curve.arm_of("--fix on --lr 3e-3") == "--fix on"
    assert lr_curve.arm_of("--lr 1e-2 --attn fp32") == "--attn fp32"
    assert lr_curve.arm_of("--fix off --pos rope") == "--fix off --pos rope"
    assert lr_curve.arm_of("--pos rope --fix off --lr=1e-3") == "--fix off --pos rope"
    assert lr_curve.arm_of("--pos=rope --attn fp32") == "--attn fp32 --pos rope"
    assert lr_curve.arm_of("--fix off --qk-norm") is None and lr_curve.arm_of(None) is None


def test_first_past_is_the_first_logged_step_above_and_none_without_one():
    log = {"step": np.array([1000.0, 2000, 3000, 4000]), lr_curve.LOGIT: np.array([20.0, np.nan, 150, 90])}
    run = Run(None, {}, {}, log)
    assert lr_curve.first_past(run) == 3000   # (the empty cell is no row of the series)
    assert lr_curve.first_past(run, 200) is None
    assert lr_curve.first_past(Run(None, {}, {}, {"step": log["step"]})) is None   # no diagnostics logged


def test_committed_curve_is_its_studies_runs():
    """results/lr_sweep/lr_curve.csv is points() of the four studies, regenerated, never typed; each arm has a run at
    lr 1e-2, and all but the fp32 control of rotary positions (run at 1e-2 alone) the default lr's runs too."""
    root = Path(__file__).resolve().parent.parent / "results"
    tables = [root / study / "runs.csv" for study in ("lr_sweep", "seed_study", "cure", "modern_block")]
    rows = lr_curve.points(tables)
    committed = read_table(root / "lr_sweep" / "lr_curve.csv")
    assert [{k: row[k] for k in lr_curve.COLUMNS} for row in committed] == rows
    rates = {arm: [row["lr"] for row in rows if row["arm"] == arm] for arm in lr_curve.ARMS}
    assert all(1e-2 in rates[arm] for arm in rates)
    assert [arm for arm in rates if 1e-3 not in rates[arm]] == ["--attn fp32 --pos rope"]


def refusal(argv, capsys):
    """lr_curve.main's refusal of argv: exit status 2, one line on stderr; that line."""
    with pytest.raises(SystemExit) as exited:
        lr_curve.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1
    return err


def test_no_such_table_is_one_line(tmp_path, capsys):
    assert refusal(["nope.csv", "--out", str(tmp_path)], capsys) == \
        "python -m experiments.lr_curve: error: no such file: nope.csv\n"


def test_a_table_that_is_no_runs_csv_or_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    results = Path(__file__).resolve().parent.parent / "results"
    binary, bench, out = tmp_path / "binary.csv", results / "speed" / "bench.csv", tmp_path / "out"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xd0\xff")
    out.write_text("a file\n")
    for argv, line in (([str(binary)], f"{binary} is not UTF-8 text"),
                       ([str(bench)], f"{bench} is not a study's runs.csv: no column name, arm, flags"),
                       ([str(results / "lr_sweep" / "runs.csv"), "--out", str(out)],
                        f"--out must be a folder: cannot make {out / 'figures'}")):
        assert refusal(argv, capsys).startswith(f"python -m experiments.lr_curve: error: {line}")
    assert out.read_text() == "a file\n"


def test_a_kept_log_that_is_gone_or_damaged_is_one_line(tmp_path, capsys):
    """A run whose runs.csv row says its log is kept is never read as one that did not pass 100: a log gone, or one
    that cannot be read, is refused in one line naming it."""
    study = Path(__file__).resolve().parent.parent / "results" / "lr_sweep"
    copy = tmp_path / "lr_sweep"
    (copy / "runs").mkdir(parents=True)
    (copy / "runs.csv").write_bytes((study / "runs.csv").read_bytes())
    out = ["--out", str(tmp_path / "out")]
    assert "says these runs' logs are kept, but there is none in" in refusal([str(copy / "runs.csv"), *out], capsys)
    for run in (study / "runs").iterdir():
        (copy / "runs" / run.name).mkdir()
        for f in run.iterdir():
            (copy / "runs" / run.name / f.name).write_bytes(f.read_bytes())
    log = next((copy / "runs" / "off-lr3e-3-s0").glob("log.csv*"))
    log.write_bytes(log.read_bytes()[:-100])   # cut short
    assert refusal([str(copy / "runs.csv"), *out], capsys).startswith(
        f"python -m experiments.lr_curve: error: {log} cannot be read (")


def test_the_small_table_has_a_row_per_rate_and_a_cell_per_arm():
    """markdown: one run's cell is its collapse in bold or the steps without one, and layer 0's first step past 100
    where it passed, and its seed where that is not 0; several runs' cell counts the collapses and spans the steps;
    an arm not run at a rate reads "-". A run without its log is not counted among those that never passed 100."""
    point = lambda arm, lr, collapsed, steps, past, seed=0, log=True: dict(arm=arm, lr=lr, seed=seed, steps=steps,
                                                                         collapsed=collapsed, past_100_step=past,
                                                                         collapse_step=steps if collapsed else None,
                                                                         log_kept=log)
    lines = lr_curve.markdown([point("--fix off", 3e-3, True, 34_300, 4_000), point("--fix off", 3e-3, False, 40_000,
                               19_000, 1), point("--fix on", 3e-3, False, 40_000, None), point("--fix on", 3e-3, False,
                               20_000, 9_000, 1), point("--fix off", 3e-4, False, 40_000, None), point("--fix on", 3e-4,
                               True, 5_000, 1_000), point("--fix on", 3e-4, True, 7_000, 1_000, 1),
                               point("--attn fp32", 3e-4, False, 40_000, None, 2)])
    assert lines == ["| lr | `--fix off` | `--fix on` | `--attn fp32` | `--fix off --pos rope` | "
                     "`--attn fp32 --pos rope` |",
                     "|---|---|---|---|---|---|",
                     "| 3e-4 | no collapse in 40,000 | 2 runs: **2 collapsed, at 5,000-7,000**; past 100 at 1,000 (2 of 2) "
                     "| seed 2: no collapse in 40,000 | - | - |",
                     "| 3e-3 | 2 runs: **1 collapsed, at 34,300**, 1 ran 40,000 without; past 100 at 4,000-19,000 (2 of 2) "
                     "| 2 runs: no collapse in 20,000-40,000; past 100 at 9,000 (1 of 2) | - | - | - |"]
    unlogged = lr_curve.markdown([point("--fix off", 1e-3, True, 45_960, 30_000),
                                  point("--fix off", 1e-3, True, 75_010, None, 1, log=False),
                                  point("--fix on", 1e-3, False, 150_000, None, log=False)])
    assert unlogged[2] == "| 1e-3 | 2 runs: **2 collapsed, at 45,960-75,010**; past 100 at 30,000 (1 of the 1 with " \
                          "logs) | no collapse in 150,000; no log | - | - | - |"
    none_past = lambda *logs: lr_curve.markdown([point("--fix on", 1e-3, False, 1_000, None, seed, log)
                                                 for seed, log in enumerate(logs)])[2]
    assert [none_past(False, False), none_past(True, False), none_past(True, True)] == [
        "| 1e-3 | - | 2 runs: no collapse in 1,000; no log | - | - | - |",
        "| 1e-3 | - | 2 runs: no collapse in 1,000; 1 of 2 without a log | - | - | - |",
        "| 1e-3 | - | 2 runs: no collapse in 1,000 | - | - | - |"]


def test_a_rates_row_is_named_as_the_flags_write_it():
    """Each lr its own row, named as --lr writes it: 1.5e-3 and 2e-3 two rows, not two of "2e-3"."""
    point = lambda lr: dict(arm="--fix off", lr=lr, seed=0, steps=100, collapsed=False, past_100_step=None,
                            collapse_step=None, log_kept=True)
    assert [line.split(" | ")[0] for line in lr_curve.markdown([point(1.5e-3), point(2e-3), point(1e-3)])[2:]] == \
        ["| 1e-3", "| 1.5e-3", "| 2e-3"]


def test_the_curve_goes_beside_its_first_table_and_a_run_without_an_lr_is_one_line(tmp_path, capsys):
    """Without --out, lr_curve.csv and figures/ go to the first table's folder (never another study's committed
    curve); a run of an arm whose lr cell is empty is refused in one line naming it."""
    copy = tmp_path / "lr_sweep"
    shutil.copytree(Path(__file__).resolve().parent.parent / "results" / "lr_sweep" / "runs", copy / "runs")
    lines = (Path(__file__).resolve().parent.parent / "results" / "lr_sweep" / "runs.csv").read_text().splitlines()
    (copy / "runs.csv").write_text("\n".join(lines) + "\n")
    assert lr_curve.main([str(copy / "runs.csv")]) is None
    assert (copy / "lr_curve.csv").exists() and (copy / "figures" / "lr_curve.png").exists()
    header = lines[0].split(",")
    cells = lines[1].split(",")
    cells[header.index("lr")] = ""
    (copy / "runs.csv").write_text("\n".join([lines[0], ",".join(cells)] + lines[2:]) + "\n")
    with pytest.raises(SystemExit):
        lr_curve.main([str(copy / "runs.csv")])
    assert f"{copy / 'runs.csv'}: {cells[0]} has no lr" in capsys.readouterr().err


def test_a_run_whose_log_is_not_kept_is_a_point_without_a_step_past_100(tmp_path, capsys):
    """A runs.csv row that says its log is not kept is a point all the same: log_kept False and no step past 100 in
    lr_curve.csv, and "no log" in main's line for it, never a step or "-" (never past)."""
    study = Path(__file__).resolve().parent.parent / "results" / "lr_sweep"
    copy = tmp_path / "lr_sweep"
    lines = (study / "runs.csv").read_text().splitlines()
    gone = next(i for i, line in enumerate(lines) if line.startswith("off-lr3e-3-s0,"))
    assert lines[gone].endswith(",True")
    lines[gone] = lines[gone][:-len("True")] + "False"
    for run in (study / "runs").iterdir():
        if run.name != "off-lr3e-3-s0":
            (copy / "runs" / run.name).mkdir(parents=True)
            for f in run.iterdir():
                (copy / "runs" / run.name / f.name).write_bytes(f.read_bytes())
    (copy / "runs.csv").write_text("\n".join(lines) + "\n")
    lr_curve.main([str(copy / "runs.csv"), "--out", str(tmp_path / "out")])
    said = [line for line in capsys.readouterr().out.splitlines() if " off-lr3e-3-s0 " in line]
    assert len(said) == 1 and said[0].endswith("layer 0 past 100: no log")
    row = next(r for r in read_table(tmp_path / "out" / "lr_curve.csv") if r["name"] == "off-lr3e-3-s0")
    assert row["log_kept"] is False and row["past_100_step"] is None and row["collapse_step"] == 34_300
