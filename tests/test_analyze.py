"""analyze.py on small synthetic run folders."""

import csv
import json
import os
import re
import shutil
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

import analyze
import train
from nanolp import plots, probe
from nanolp.diagnostics import diag_columns
from nanolp.plots import PALETTE, run_styles
from nanolp.runconfig import as_current, as_shipped
from nanolp.runs import STUDY_COLUMNS, Run, find_runs, load_run, load_runs, read_table, study_runs, write_csv

N_LAYER, N_HEAD = 2, 2  # the tiny preset's
STEPS = np.arange(0, 400, 10)
COLLAPSE_STEP = 300


def columns():
    return (["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]
            + diag_columns(N_LAYER, N_HEAD))


def synthetic_log(collapse, rng):
    """One row per step. The collapsing run's layer 1 W_Q grows and its loss explodes at the collapse; diagnostics
    (the probe's columns included) are logged every other row, val every 5th."""
    rows = []
    for step in STEPS:
        row = dict(step=step, elapsed_s=step * 1.5, tokens=step * 1024, lr=1e-3,
                   train_loss=(12.0 if collapse and step >= COLLAPSE_STEP else 4.0 - step / 200),
                   val_loss=(4.1 - step / 200 if step % 50 == 0 else ""),
                   grad_norm=1.0, tokens_per_s=5000.0, mfu=0.1)
        diag = step % 20 == 0
        for i in range(N_LAYER):
            grow = 1 + (step / 100 if collapse and i == 1 else step / 1000)
            row |= {f"max_logit_L{i}": 10 * grow, f"tie_rate_L{i}": 0.01 + 0.001 * rng.random(),
                    f"sn_q_L{i}": grow, f"sn_k_L{i}": grow, f"delta_err_L{i}": -1e-3 if collapse else 1e-4,
                    f"delta_push_L{i}": 1e-3 if collapse else 0.0, f"sharp_rate_L{i}": 0.02}
            row |= {f"sn_q_L{i}_H{h}": grow * (h + 1) for h in range(N_HEAD)}
        row |= {c: 1e-10 if "_se_" in c else rng.normal(1e-10, 1e-10) for c in columns() if c.startswith("probe_")}
        if not diag:  # diagnostics not computed on this row: empty cells
            row |= {c: "" for c in columns() if "_L" in c}
        rows.append(row)
    return rows


def write_run(root, name, seed, collapse, rng, **settings):
    """A run folder as train.py writes it, with the tiny preset's config and the given settings."""
    run = root / name
    run.mkdir(parents=True)
    config = dict(preset="tiny", fix="off", attn="kernel", exponent="fma", seed=seed, n_layer=N_LAYER,
                  n_head=N_HEAD) | settings
    (run / "config.json").write_text(json.dumps(config))
    rows = synthetic_log(collapse, rng)
    with open(run / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns())
        writer.writeheader()
        writer.writerows(rows)
    final_val = [r["val_loss"] for r in rows if r["val_loss"] != ""][-1]
    summary = dict(config, name=name, collapsed=collapse, collapse_step=COLLAPSE_STEP if collapse else None,
                   collapse_minute=COLLAPSE_STEP * 1.5 / 60 if collapse else None, reason=None,
                   steps=int(STEPS[-1]), minutes=STEPS[-1] * 1.5 / 60, final_val_loss=final_val,
                   final_train_loss=rows[-1]["train_loss"], max_logit=None, tokens_per_s=5000.0, mfu=0.1)
    (run / "summary.json").write_text(json.dumps(summary))
    return rows


def fake_run(**config):
    """A run of this config (with the exponent, which runs before the option lack), as loading its config.json
    reads it: an older run's spellings in today's (nanolp.runconfig.as_current)."""
    return Run(Path("r"), as_current({"exponent": "fma", **config}), {}, {})


# -----------------------------------------------------------------------------
# Arms: the train.py flags that differ from the preset


def test_runs_before_the_exponent_option_are_named_so():
    """A run of our kernel that did not record the exponent ran neither form (ptxas fused it in some tiles): its arm
    says so rather than read as the default; torch's attentions have no exponent to speak of."""
    assert analyze.arm(Run(Path("r"), dict(fix="off"), {}, {})) == "--fix off (before --exponent)"
    assert analyze.arm(Run(Path("r"), dict(attn="sdpa"), {}, {})) == "--attn sdpa"
    assert analyze.arm(fake_run(fix="off", exponent="torch")) == "--fix off --exponent torch"


@pytest.mark.parametrize("config, expected", [
    (dict(fix="off", seed=3, steps=60000, minutes=12.0, diag_interval=250, name="x", out="y"), "--fix off"),
    (dict(fix="on", lr=3e-3), "--fix on --lr 3e-3"),
    (dict(fix="paper", delta="fp32-o"), "--fix paper --delta fp32-o"),
    (dict(fix="off", stochastic_o="forward"), "--fix off --stochastic-o forward"),
    (dict(fix="off", mantissa_bits=3, amplify="p"), "--fix off --mantissa-bits 3"),
    (dict(fix="on", attn="sdpa", precision="autocast", delta="p"), "--attn sdpa"),  # ignored by torch's
    # older runs, in the spellings of their day
    (dict(fix="paper", delta_fp32=True), "--fix paper --delta fp32-o"),
    (dict(fix="off", delta_from_p=True, delta_fp32=False, stochastic_o="off"), "--fix off --delta p"),
    (dict(fix="off", precision="paper"), "--fix off --precision autocast"),
    (dict(fix="on", attn="sdpa", precision="paper", delta_from_p=True), "--attn sdpa"),
    (dict(attn="fp32", pos="none"), "--attn fp32 --pos none"),
    (dict(fix="off", pos="rope", qk_norm=True), "--fix off --pos rope --qk-norm"),   # a switch: its flag alone
    (dict(fix="on"), "--fix on"),  # an older run: keys added since missing
    (dict(preset="tiny", fix="off", lr=3e-3, n_layer=2), "--preset tiny --fix off"),  # the preset's own values
    (dict(preset="tiny", fix="off", n_layer=4, delta_from_p=False), "--preset tiny --fix off --n-layer 4"),
])
def test_arm_names_from_flags(config, expected):
    assert analyze.arm(fake_run(**config)) == expected


def test_an_older_preset_is_compared_with_the_default_preset():
    """A preset train.py no longer has reads as the default preset, which the others change (train.PRESETS)."""
    assert analyze.arm(fake_run(preset="gone", n_layer=4, lr=1e-3)) == "--preset gone --fix off --n-layer 4"


# -----------------------------------------------------------------------------
# The headline: median and range over seeds


def loss_run(name, steps, loss):
    steps = np.asarray(steps, dtype=float)
    log = dict(step=steps, train_loss=np.asarray(loss, dtype=float))
    return Run(Path(name), dict(fix="off", exponent="fma", seed=name[-1]), {}, log)


def test_median_only_where_three_runs_are_alive():
    a = loss_run("a-s0", [0, 100, 200, 300], [4.0, 3.0, 2.0, 1.0])
    b = loss_run("a-s1", [0, 200, 300], [5.0, 1.0, 1.0])    # logged less often: interpolated at 100 (3.0)
    c = loss_run("a-s2", [0, 100, 200], [1.0, 9.0, np.nan])  # an empty cell at 200, then stopped
    steps, middle = analyze.median_line([a, b, c], "train_loss")
    assert steps.tolist() == [0, 100, 200, 300]
    assert middle[:2].tolist() == [4.0, 3.0] and np.isnan(middle[2:]).all()   # from 200 on, two are alive
    # two runs: no median at all (the median of two, where one ends, would jump to the other and read as a recovery)
    assert analyze.median_line([a, b], "train_loss") is None
    assert analyze.median_line([a, b, c], "val_loss") is None


def ended_run(name, steps, collapse_step=None):
    summary = dict(steps=steps, collapsed=collapse_step is not None, collapse_step=collapse_step)
    return Run(Path(name), dict(fix="off", exponent="fma", seed=name[-1]), summary, {})


def test_survival_falls_at_each_collapse_among_the_runs_still_training():
    runs = [ended_run("a-s0", 100, 100), ended_run("a-s1", 150), ended_run("a-s2", 300, 200),
            ended_run("a-s3", 400)]
    steps, share = analyze.survival(runs)
    # at 100 one of 4 falls; a-s1 stops at 150 without collapsing; at 200 one of the 2 still training falls
    assert steps.tolist() == [0, 100, 200, 400]
    assert share.tolist() == [1.0, 0.75, 0.375, 0.375]
    steps, share = analyze.survival([ended_run("b-s0", 500), ended_run("b-s1", 600)])
    assert steps.tolist() == [0, 600] and share.tolist() == [1.0, 1.0]   # none collapsed: flat at all
    # a run that ended without a collapse at the step where another collapsed was still training there: 1 of 2 fell
    steps, share = analyze.survival([ended_run("c-s0", 500), ended_run("c-s1", 500, 500)])
    assert steps.tolist() == [0, 500, 500] and share.tolist() == [1.0, 0.5, 0.5]


def headline(runs, study, monkeypatch):
    """The headline figure of `runs` (and `study`, the runs of their runs.csv), not saved."""
    figures = []
    monkeypatch.setattr(analyze, "save", lambda fig, path: figures.append(fig) or path)
    analyze.plot_headline(runs, study, Path("h.png"), "the kernel as it ships")
    return figures[0]


def test_headline_draws_each_run_to_its_end(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    for seed, collapse in ((0, True), (1, False), (2, False)):
        write_run(tmp_path, f"off-s{seed}", seed, collapse, rng)
    write_run(tmp_path, "o32-s0", 0, False, rng, delta="fp32-o")  # an internal name: the legend must not use it
    runs = [load_run(p) for p in sorted(tmp_path.iterdir())]
    fig = headline(runs, runs, monkeypatch)
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts == ["python train.py --preset tiny --fix off --delta fp32-o: 1 run: no collapse in 390 steps",
                     "python train.py --preset tiny --fix off: 3 runs: 1 collapsed at step 300; 2 without a collapse "
                     "in 390 steps",
                     "median of an arm's lines, while all of them (at least 3) are alive", "collapse",
                     "a run's end without a collapse (right)"]
    loss, logit, alive = fig.axes
    hues = [h.get_color() for h in fig.legends[0].legend_handles[:2]]
    assert hues == ["tab:purple", "tab:red"]   # one hue per arm, its family's own
    assert all(ax.get_xlim() == (0, 1.02 * 390) for ax in fig.axes)   # the axes end where the runs end
    off = [r for r in runs if r.name.startswith("off")]
    for ax, column in ((loss, "train_loss"), (logit, analyze.LOGIT)):
        # a thin line per run, each to its own end, one X, and one median (off's three runs)
        assert [line.get_linewidth() for line in ax.lines].count(0.8) == 4
        assert [line.get_marker() for line in ax.lines].count("X") == 1
        medians = [line for line in ax.lines if line.get_linewidth() > 2]
        assert len(medians) == 1 and np.allclose(medians[0].get_ydata(), analyze.median_line(off, column)[1])
    assert loss.get_yscale() == logit.get_yscale() == "log"
    steps = [line for line in alive.lines if line.get_marker() != "|"]
    assert [np.round(line.get_ydata(), 6).tolist() for line in steps] == [[1.0, 1.0], [1.0, 0.666667, 0.666667]]
    ticks = [line for line in alive.lines if line.get_marker() == "|"]
    assert [line.get_xdata().tolist() for line in ticks] == [[390], [390, 390]]   # where each run ended


def test_headline_counts_every_run_of_the_study(tmp_path, monkeypatch):
    """Lines for the runs with logs; the survival panel and the legend over every row of runs.csv, the rows without
    a log included, so that they say what README's table says."""
    study = tmp_path / "study"
    rng = np.random.default_rng(0)
    write_run(study / "runs", "off-s0", 0, True, rng, preset="default", n_layer=6, n_head=6)   # the default's shape
    rows = [dict(name="off-s0", arm="off", flags="--fix off", seed=0, attn="kernel", fix="off", exponent="fma", collapsed=True,
                 collapse_step=COLLAPSE_STEP, collapse_minute=7.5, steps=390, minutes=9.75, max_logit=5e8,
                 tokens_per_s=5000.0, log_kept=True, variant="", lr=1e-3)]
    rows += [dict(name=f"off-s{seed}-nolog", arm="off", flags="--fix off", seed=seed, attn="kernel", fix="off", exponent="fma",
                  collapsed=True, collapse_step=step, collapse_minute=step / 40, steps=step + 5, minutes=step / 40,
                  max_logit=1e9,
                  tokens_per_s=5000.0, log_kept=False, variant="", lr=1e-3) for seed, step in ((1, 600), (2, 900))]
    rows += [dict(name="sdpa-s0-nolog", arm="sdpa", flags="--attn sdpa", seed=0, attn="sdpa", fix="off",
                  collapsed=False, collapse_step="", collapse_minute="", steps=1000, minutes=25.0, max_logit=3e5,
                  tokens_per_s=5000.0, log_kept=False, variant="", lr=1e-3),
             dict(name="patched-s0-nolog", arm="patched", flags="--fix off", seed=0, attn="kernel", fix="off", exponent="fma",
                  collapsed=True, collapse_step=50, collapse_minute=1.0, steps=55, minutes=1.1, max_logit=1e9,
                  tokens_per_s=5000.0, log_kept=False, variant="a patched kernel", lr=1e-3)]
    write_csv(study / "runs.csv", rows, list(rows[0]))
    runs = [load_run(study / "runs" / "off-s0")]
    everyone = study_runs(study / "runs.csv")
    assert [run.name for run in everyone] == ["off-s0", "off-s1-nolog", "off-s2-nolog", "sdpa-s0-nolog"]
    assert everyone[0].log and not everyone[1].log   # the kept log is read; the others are their row alone
    assert [analyze.arm(run) for run in everyone] == ["--fix off"] * 3 + ["--attn sdpa"]   # runs.csv's flags

    fig = headline(runs, everyone, monkeypatch)
    texts = [t.get_text() for t in fig.legends[0].get_texts()]
    assert texts[:2] == ["python train.py --fix off: 3 runs: 3 collapsed at step 600, the median (300-900); lines: 1 of them",
                         "python train.py --attn sdpa: 1 run: no collapse in 1,000 steps; no lines"]
    table = analyze.study_table(analyze.table_rows([study / "runs.csv"]))
    assert "| **3 / 3** | 600 (300-900) |" in table[2] and "| **0 / 1** | - | 1,000 |" in table[3]
    alive = [line for line in fig.axes[2].lines if line.get_marker() != "|"]
    assert alive[0].get_xdata().tolist() == [0, 300, 600, 900, 900]   # falls at each of the table's collapses
    assert np.round(alive[0].get_ydata(), 6).tolist() == [1.0, 0.666667, 0.333333, 0.0, 0.0]
    assert alive[1].get_xdata().tolist() == [0, 1000] and alive[1].get_ydata().tolist() == [1.0, 1.0]
    assert len(fig.axes[0].lines) == 2   # off-s0's line and its X: no median of one run


def test_a_row_without_a_log_does_not_rename_a_run_with_one(tmp_path, monkeypatch):
    """An earlier run of the same arm and seed, known by its runs.csv row alone, is no twin in the figures' legends."""
    study = tmp_path / "study"
    write_run(study / "runs", "off-s0", 0, True, np.random.default_rng(0), preset="default", n_layer=6, n_head=6)
    rows = [dict(name=name, arm="off", flags="--fix off", seed=0, attn="kernel", fix="off", exponent="fma", collapsed=True,
                 collapse_step=COLLAPSE_STEP, collapse_minute=7.5, steps=390, minutes=9.75, max_logit=1e9,
                 tokens_per_s=5000.0, log_kept=kept, variant="", lr=1e-3)
            for name, kept in (("off-s0-nolog", False), ("off-s0", True))]
    write_csv(study / "runs.csv", rows, list(rows[0]))
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig) or path)
    analyze.analyze_runs([load_run(study / "runs" / "off-s0")], tmp_path)
    assert [t.get_text() for t in figures[0].legends[0].get_texts()] == ["--fix off, seed 0"]   # max_logit.png


def test_the_seed_studys_rows_are_named_by_their_flags():
    """A runs.csv row without a log reads as the run it summarises: its arm is its `flags` column, marked where the
    run of our kernel was made before the exponent option (its `exponent` cell blank)."""
    table = Path(analyze.__file__).parent / "results/seed_study/runs.csv"
    rows = [row for row in read_table(table) if not row["variant"]]
    before = lambda row: " (before --exponent)" if row["exponent"] is None and row["attn"] in analyze.OURS else ""
    assert [analyze.arm(run) for run in study_runs(table)] == [row["flags"] + before(row) for row in rows]


# -----------------------------------------------------------------------------
# The probe: per arm, pooled per phase of layer 0's max logit against its value at step 10,000

TERM_SCALE = dict(total=1e-10, lin=-2e-10, curv=3e-12, indep=5e-10)  # each term its own size, lin negative


def write_probe_run(root, name, config, logits, values, ses):
    """A run folder with a log row every 1,000 steps from step 1,000: layer 0's max logit and the probe's terms,
    each term's values and standard errors scaled by TERM_SCALE (NaN: a row without the probe)."""
    run = root / name
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({"exponent": "fma", **config}))   # as train.py records it today
    with open(run / "log.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", "max_logit_L0"] + [c for c in columns() if "probe_" in c])
        writer.writeheader()
        for i, (logit, value, se) in enumerate(zip(logits, values, ses)):
            row = dict(step=1000 * (i + 1), max_logit_L0=logit)
            for term, scale in TERM_SCALE.items():
                row |= {probe.column(term): value * scale, probe.column(term, True): se * abs(scale)}
            writer.writerow({k: "" if isinstance(v, float) and np.isnan(v) else v for k, v in row.items()})


def test_probe_pooled_per_arm_text_and_phase(tmp_path, capsys):
    """Two seeds of one arm whose probe read training batches are pooled, equally weighted per checkpoint; a run of
    the same arm from the train.py that probed validation batches (its config.json has `schedule`) is pooled apart;
    a run that never reached step 10,000 has no phases."""
    runs, out = tmp_path / "runs", tmp_path / "probe"
    # seed 0: 10 at step 10,000; a row without the probe; 19.9 is phase 1, 20 (2x) and 100 (10x) phase 2, 100.5
    # phase 3, and the dip back to 15 phase 1 again
    write_probe_run(runs, "off-s0", dict(fix="off", seed=0), [10] * 10 + [19.9, 20, 100, 100.5, 15],
                    [1, 1, 1, 1, np.nan] + [1] * 6 + [1, 2, 2, 1], [1, 1, 1, 1, np.nan] + [1] * 6 + [1, 2, 3, 1])
    # seed 1: 20 at step 10,000, then 5x (phase 2) and 20x (phase 3)
    write_probe_run(runs, "off-s1", dict(fix="off", seed=1), [20] * 10 + [100, 400], [3] * 10 + [6, 4],
                    [1] * 10 + [2, 4])
    write_probe_run(runs, "off-s2", dict(fix="off", seed=2, schedule="constant"), [10] * 10, [-1] * 10, [1] * 10)
    write_probe_run(runs, "on-s0", dict(fix="on", seed=0), [10] * 5, [1] * 5, [1] * 5)

    analyze.main(["--probe", str(runs), "--out", str(out)])

    with open(out / "probe_phases.csv", newline="") as f:
        rows = {(r["arm"], r["probe_batches"], int(r["phase"]), r["term"]): r for r in csv.DictReader(f)}
    expected = {  # (mean, s.e., checkpoints, runs) in units of each term's scale
        ("train", 1): ((11 * 1 + 10 * 3) / 21, 21 ** 0.5 / 21, 21, 2),   # seed 0: 9 + 19.9 + the dip to 15
        ("train", 2): ((1 + 2 + 6) / 3, (1 + 4 + 4) ** 0.5 / 3, 3, 2),
        ("train", 3): ((2 + 4) / 2, (9 + 16) ** 0.5 / 2, 2, 2),
        ("validation", 1): (-1, 10 ** -0.5, 10, 1),
    }
    assert sorted(rows) == sorted(("--fix off", *key, term) for key in expected for term in TERM_SCALE)
    for (text, phase), (mean, se, checkpoints, n_runs) in expected.items():
        for term, scale in TERM_SCALE.items():
            row = rows["--fix off", text, phase, term]
            assert float(row["mean"]) == pytest.approx(mean * scale, rel=1e-5)
            assert float(row["se"]) == pytest.approx(se * abs(scale), rel=1e-5)
            assert float(row["t"]) == pytest.approx(np.sign(scale) * mean / se, rel=1e-5)
            assert (int(row["checkpoints"]), int(row["runs"])) == (checkpoints, n_runs)
    assert (rows["--fix off", "train", 2, "total"]["first_step"], rows["--fix off", "train", 2, "total"]["last_step"]
            ) == ("11000", "13000")
    with open(out / "probe_runs.csv", newline="") as f:   # per run: seed 1 alone has phase 2 at 6 and phase 3 at 4
        per_run = {(r["run"], r["probe_batches"], int(r["phase"]), r["term"]): r for r in csv.DictReader(f)}
    assert {key[0] for key in per_run} == {str(runs / name) for name in ("off-s0", "off-s1", "off-s2")}
    for phase, mean, se in ((1, 3, 10 ** 0.5 / 10), (2, 6, 2), (3, 4, 4)):
        row = per_run[str(runs / "off-s1"), "train", phase, "total"]
        assert (float(row["mean"]), float(row["se"])) == pytest.approx(
            (mean * TERM_SCALE["total"], se * TERM_SCALE["total"]), rel=1e-5)
        assert row["runs"] == "1"
    report = (out / "report.md").read_text()
    assert f"- `{runs / 'on-s0'}` (`--fix on`, seed 0): probe on train batches; left out" in report
    assert "| `--fix off` | train | 2 (2-10x) | 3 (2) | 11,000-13,000 | +3.00e-10 ± 1.0e-10 (t +3.0) |" in report
    assert "| `--fix off` | validation | 1 (below 2x) | 10 (1) |" in capsys.readouterr().out
    figures = ["delta_probe_fix-off.png", "delta_probe_fix-on.png", "probe_phases.png"]   # a per-run figure per arm
    assert sorted(p.name for p in out.glob("*.png")) == figures
    assert all((out / figure).stat().st_size > 0 and f"({figure})" in report for figure in figures)


def test_probe_keeps_two_runs_of_one_name_apart_by_their_paths(tmp_path):
    """Two studies' runs of one name (off-s0 here and there) are two rows of probe_runs.csv, each named by its
    folder, not one run pooled of both."""
    write_probe_run(tmp_path / "a" / "runs", "off-s0", dict(fix="off", seed=0), [10] * 10, [1] * 10, [1] * 10)
    write_probe_run(tmp_path / "b" / "runs", "off-s0", dict(fix="off", seed=0), [10] * 10, [3] * 10, [1] * 10)
    write_probe_run(tmp_path / "b" / "runs", "off-s1", dict(fix="off", seed=1), [10] * 10, [5] * 10, [1] * 10)
    analyze.main(["--probe", str(tmp_path / "a" / "runs"), str(tmp_path / "b" / "runs"), "--out", str(tmp_path / "p")])
    with open(tmp_path / "p" / "probe_runs.csv", newline="") as f:
        total = {r["run"]: float(r["mean"]) for r in csv.DictReader(f) if r["term"] == "total"}
    assert total == pytest.approx({str(tmp_path / "a/runs/off-s0"): 1 * TERM_SCALE["total"],
                                   str(tmp_path / "b/runs/off-s0"): 3 * TERM_SCALE["total"],
                                   str(tmp_path / "b/runs/off-s1"): 5 * TERM_SCALE["total"]})


def test_probe_refuses_runs_without_a_reference_step(tmp_path, capsys):
    """Runs with the probe that all stop before step 10,000 (tiny runs, say): one line, no empty tables or figure."""
    runs, out = tmp_path / "runs", tmp_path / "probe"
    write_probe_run(runs, "tiny-s0", dict(fix="off", seed=0), [10] * 5, [1] * 5, [1] * 5)
    assert refused(["--probe", str(runs), "--out", str(out)], capsys) == (
        "analyze.py: error: no run with the probe reaches step 10,000, where its phases start: tiny-s0\n")
    assert not any(out.iterdir())   # (the folder made, nothing written)


# -----------------------------------------------------------------------------
# The whole command


def test_runs_report_and_figures(tmp_path):
    rng = np.random.default_rng(0)
    runs = tmp_path / "runs"
    collapsed = write_run(runs, "off-s0", 0, True, rng)
    write_run(runs, "on-s0", 0, False, rng, fix="on")
    write_run(runs, "sdpa-s1", 1, False, rng, attn="sdpa")
    # a run still in progress: no summary.json, no val loss, no diagnostics at all
    partial = runs / "partial"
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps(dict(preset="tiny", fix="paper", exponent="fma", seed=5)))
    (partial / "log.csv").write_text("step,elapsed_s,tokens,lr,train_loss,val_loss\n"
                                     "0,0,0,0.001,4.2,\n10,5,1024,0.001,4.0,\n")

    analyze.main([str(runs)])

    out = runs / "figures"
    for name in ("headline", "loss", "max_logit", "spectral_norm", "spectral_norm_heads", "tie_rate", "delta_err"):
        assert (out / f"{name}.png").stat().st_size > 0, name
    report = (out / "report.md").read_text()
    assert f"\non-s0, partial, sdpa-s1: {train.TINY_NOTE}." in report   # the tiny runs checked the pipeline (not
    # off-s0, which collapsed: train.py does not say it either)
    row = next(line for line in report.splitlines() if line.startswith(f"| `{runs / 'off-s0'}`"))
    assert f"| `--preset tiny --fix off` | 0 | 390 | step {COLLAPSE_STEP}, {COLLAPSE_STEP * 1.5 / 60:.1f} min" in row
    assert f"{[r['val_loss'] for r in collapsed if r['val_loss'] != ''][-1]:.4f}" in row
    # what its log says: the last train loss, no val loss, no logits, no speed
    assert (f"| `{partial}` | `--preset tiny --fix paper` | 5 | 10 | no, but stopped before its end (killed) "
            "| 4.0000 | n/a | n/a | n/a |" in report)
    assert "| `--preset tiny --attn sdpa` | 0/1 | 0 | - | 390 |" in report
    assert "| `--preset tiny --fix paper` | 0/0 | 1 | - | 10 |" in report   # killed: not a run without a collapse
    # the synthetic collapsing run grows W_Q in layer 1: 4.9x, against 1.4x in layer 0
    assert "Largest, at least 2x every other layer's: **layer 1**" in report
    assert (out / "rates.csv").stat().st_size > 0


def test_a_study_given_in_two_spellings_is_one_study(tmp_path, monkeypatch):
    """Runs of one study named by a relative and an absolute path: one table of the study, its runs counted once."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    rows = []
    for seed in (0, 1):
        write_run(tmp_path / "a" / "runs", f"off-s{seed}", seed, True, rng)
        rows.append(dict(name=f"off-s{seed}", arm="off", flags="--fix off", seed=seed, attn="kernel", fix="off",
                         exponent="fma", collapsed=True, collapse_step=COLLAPSE_STEP, collapse_minute=7.5, steps=390,
                         minutes=9.75, max_logit=5e8, tokens_per_s=5000.0, log_kept=True, variant="", lr=1e-3))
    write_csv(tmp_path / "a" / "runs.csv", rows, list(rows[0]))
    analyze.main(["a/runs/off-s0", str(tmp_path / "a" / "runs" / "off-s1"), "--out", "figures"])
    report = (tmp_path / "figures" / "report.md").read_text()
    assert report.count("All runs of") == 1 and "| 2 (0, 1) |" in report
    # a table two folders up is the study's only where the runs are its runs/ (STUDY/runs.csv, STUDY/runs/NAME)
    shutil.copytree(tmp_path / "a" / "runs", tmp_path / "a" / "mine")
    analyze.main(["a/mine", "--out", "mine"])
    assert "All runs of" not in (tmp_path / "mine" / "report.md").read_text()


def test_two_studies_report_their_tables_then_the_runs_with_logs(tmp_path, capsys):
    """Each study's table of every run (its runs.csv), then one table of the runs with logs; a run named twice (its
    folder and the folder of runs it is in) is one run."""
    rng = np.random.default_rng(0)
    for study in ("a", "b"):
        write_run(tmp_path / study / "runs", "off-s0", 0, True, rng)
        row = dict(name="off-s0", arm="off", flags="--fix off", seed=0, attn="kernel", fix="off", exponent="fma",
                   collapsed=True, collapse_step=COLLAPSE_STEP, collapse_minute=7.5, steps=390, minutes=9.75,
                   max_logit=5e8, tokens_per_s=5000.0, log_kept=True, variant="", lr=1e-3)
        write_csv(tmp_path / study / "runs.csv", [row], list(row))
    given = [tmp_path / "a" / "runs", tmp_path / "a" / "runs" / "off-s0", tmp_path / "b" / "runs"]
    assert find_runs(given) == [tmp_path / "a" / "runs" / "off-s0", tmp_path / "b" / "runs" / "off-s0"]
    assert find_runs(given[::-1]) == [tmp_path / "b" / "runs" / "off-s0", tmp_path / "a" / "runs" / "off-s0"]
    analyze.main([*map(str, given), "--out", str(tmp_path / "figures")])
    report = (tmp_path / "figures" / "report.md").read_text().splitlines()
    heads = [i for i, line in enumerate(report) if line.startswith(("All runs of", "The runs with logs:"))]
    assert [report[i].split(" `")[0].rstrip(":") for i in heads] == ["All runs of", "All runs of", "The runs with logs"]
    runs_table = report[heads[2]:report.index("### Per arm")]
    assert [line.split(" | ")[0] for line in runs_table if line.endswith("| 5,000 |")] == [
        f"| `{tmp_path / study / 'runs' / 'off-s0'}`" for study in ("a", "b")]   # off-s0 of a given twice: once


def test_a_run_folder_with_a_damaged_file_is_left_out(tmp_path, capsys):
    """A summary.json or config.json that cannot be parsed (a disk that filled, a run killed as it wrote it): the run
    is named in one line and left out of the figures, the report and the study's table; the others are drawn."""
    rng = np.random.default_rng(0)
    runs = tmp_path / "runs"
    write_run(runs, "off-s0", 0, True, rng)
    for name, damaged in (("on-s0", "summary.json"), ("on-s1", "config.json")):
        write_run(runs, name, 0, False, rng, fix="on")
        (runs / name / damaged).write_text('{"fix": "on", "seed')
    write_run(runs, "on-s2", 0, False, rng, fix="on")   # and one edited by hand: its steps as text
    edited = runs / "on-s2" / "summary.json"
    edited.write_text(json.dumps({**json.loads(edited.read_text()), "steps": "390"}))
    analyze.main([str(runs)])
    assert [line for line in capsys.readouterr().out.splitlines() if "left out" in line] == [
        f"{runs / name}: left out, {runs / name / damaged} cannot be parsed as JSON (Unterminated string starting "
        f"at: line 1 column 15 (char 14))" for name, damaged in (("on-s0", "summary.json"), ("on-s1", "config.json"))
    ] + [f'{runs / "on-s2"}: left out, {edited}: "steps" is "390", not an integer']
    report = (runs / "figures" / "report.md").read_text()
    assert "off-s0" in report and "on-s" not in report
    # the study's table: layer 0's peak from the kept logs that can be read
    rows = [dict(name=name, arm=name[:-3], flags="", seed=int(name[-1]), collapsed=False, collapse_step=None,
                 collapse_minute=None, steps=390, tokens_per_s=None, max_logit=None, log_kept=True, folder=tmp_path,
                 run_dir=runs / name)
            for name in ("off-s0", "on-s0", "on-s1")]
    table = analyze.study_table(rows)
    assert not table[2].endswith("| - |") and table[3].endswith("| - |")


def test_two_studies_arms_of_one_name_and_other_flags_stand_apart():
    """An arm of one name in two studies with other flags (fp32 attention on TinyShakespeare and on the corpus) is
    two commands: counted apart, the second named by its flags."""
    row = lambda flags: dict(arm="attn-fp32", flags=flags, attn="fp32")
    arms = analyze.rows_by_arm([row("--attn fp32"), row("--preset corpus --attn fp32"), row("--attn fp32")])
    assert {name: len(group) for name, group in arms.items()} == {
        "attn-fp32": 2, "attn-fp32 (--preset corpus --attn fp32)": 1}
    assert analyze.quoted(list(arms)[1]) == "`attn-fp32` (--preset corpus --attn fp32)"


def test_one_table_of_two_studies(tmp_path, monkeypatch):
    """A marker naming two runs.csv gets one table of both studies' rows, each run's layer-0 peak read from its own
    study's kept log; a marker naming one of them alone is a block of its own, left to its own command."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    tables = []
    arms = (("base", "off-s0", "--fix off", True), ("modern", "rope-s0", "--fix off --pos rope", False))
    for study, name, flags, collapse in arms:
        write_run(tmp_path / study / "runs", name, 0, collapse, rng, pos="rope" if "rope" in flags else "learned")
        if study == "modern":   # its own peak: layer 0's logits doubled
            log = tmp_path / study / "runs" / name / "log.csv"
            rows = list(csv.DictReader(open(log)))
            for row in rows:
                row["max_logit_L0"] = row["max_logit_L0"] and 2 * float(row["max_logit_L0"])
            write_csv(log, rows, list(rows[0]))
        summary = json.loads((tmp_path / study / "runs" / name / "summary.json").read_text())
        write_csv(tmp_path / study / "runs.csv", [dict(summary, arm=name[:-3], flags=flags, log_kept=True, lr=1e-3)],
                  list(summary) + ["arm", "flags", "log_kept", "lr"])
        tables.append(f"{study}/runs.csv")
    both, alone = (f"<!-- table: python analyze.py --table {t} -->\nold\n<!-- end of table -->\n"
                   for t in (" ".join(tables), tables[0]))
    (tmp_path / "README.md").write_text(both + alone)
    analyze.update_docs(tmp_path, [Path(t) for t in tables])   # as `python analyze.py --table base/... modern/...`
    lines = (tmp_path / "README.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| `python train.py")]
    peaks = [peak_of(tmp_path / study / "runs" / name) for study, name in (("base", "off-s0"), ("modern", "rope-s0"))]
    assert [row.split(" | ")[0] for row in rows] == [f"| `python train.py {flags}`" for _, _, flags, _ in arms]
    assert [row.split(" | ")[-1] for row in rows] == [f"{p:.3g} |" for p in peaks] and peaks[0] != peaks[1]
    assert lines[-2] == "old"   # the block of base/runs.csv alone is not this command's


def test_a_block_without_its_end_marker_is_refused_and_no_doc_written(tmp_path, monkeypatch, capsys):
    """A block whose end marker is gone (or comes only after another block's marker) would take the text up to the
    next end marker with it: --table refuses in one line, and writes no doc, the other docs' blocks included."""
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "study" / "runs", "off-s0", 0, True, np.random.default_rng(0))
    summary = json.loads((tmp_path / "study" / "runs" / "off-s0" / "summary.json").read_text())
    write_csv(tmp_path / "study" / "runs.csv", [dict(summary, arm="off", flags="--fix off", log_kept=True, lr=1e-3)],
              list(summary) + ["arm", "flags", "log_kept", "lr"])
    marker = "<!-- table: python analyze.py --table study/runs.csv -->"
    readme = f"{marker}\nold\n<!-- end of table -->\n"
    unended = f"{marker}\nold\n## a section\n<!-- all runs: python analyze.py --table other.csv -->\nx\n" \
              "<!-- end of all runs -->\nkept\n<!-- end of table -->\n"
    for text in (unended, f"{marker}\nold\n"):
        (tmp_path / "README.md").write_text(readme)
        (tmp_path / "docs").mkdir(exist_ok=True)
        (tmp_path / "docs/findings.md").write_text(text)
        with pytest.raises(SystemExit):
            analyze.update_docs(tmp_path, [Path("study/runs.csv")])
        assert "docs/findings.md: the block <!-- table:" in capsys.readouterr().err
        assert (tmp_path / "README.md").read_text() == readme and (tmp_path / "docs/findings.md").read_text() == text


def test_loss_table_reads_each_runs_lowest_losses_and_runaway_layer(tmp_path):
    """The memorisation block: per kept run, the collapse (or the steps run), the lowest train loss, the lowest val
    loss at its step (here a run whose val loss turns up at step 100, memorising), the layer that peaked highest."""
    rng = np.random.default_rng(0)
    rows = []
    for name, collapse in (("off-s0", True), ("on-s0", False)):
        write_run(tmp_path / "runs", name, 0, collapse, rng)
        log = tmp_path / "runs" / name / "log.csv"
        lines = list(csv.DictReader(open(log)))
        for line in lines:
            if line["val_loss"] and not collapse:   # lowest at step 100, then rising
                line["val_loss"] = 3.0 + abs(int(line["step"]) - 100) / 100
            if line["max_logit_L0"] and not collapse:
                line["max_logit_L0"] = 3 * float(line["max_logit_L0"])
        write_csv(log, lines, list(lines[0]))
        rows.append(dict(json.loads((tmp_path / "runs" / name / "summary.json").read_text()), arm=name[:-3],
                         flags=f"--fix {name[:-3]}", log_kept=True, lr=1e-3))
    write_csv(tmp_path / "runs.csv", rows, list(rows[0]))
    table = analyze.loss_table(analyze.table_rows([tmp_path / "runs.csv"]))
    logs = {name: list(csv.DictReader(open(tmp_path / "runs" / name / "log.csv"))) for name in ("off-s0", "on-s0")}
    peak = lambda name, i: max(float(r[f"max_logit_L{i}"]) for r in logs[name] if r[f"max_logit_L{i}"])
    assert table[2] == (f"| `off-s0` (`--fix off`) | {COLLAPSE_STEP:,} | {4.0 - 290 / 200:.3f} | "   # 290: before it
                        f"{4.1 - 350 / 200:.3f} (350) | 1 ({peak('off-s0', 1):.3g}) |")
    assert table[3] == (f"| `on-s0` (`--fix on`) | none in {STEPS[-1]:,} | {4.0 - 390 / 200:.3f} | 3.000 (100) | "
                        f"0 ({peak('on-s0', 0):.3g}) |")
    assert len(table) == 4


def test_loss_table_leaves_out_a_damaged_run_and_marks_a_column_a_log_lacks(tmp_path, capsys):
    """A kept run that cannot be read is named and left out (the next run keeps its own numbers); a log without val
    rows or max logits has `-` in those cells."""
    rng = np.random.default_rng(0)
    rows = []
    for name in ("off-s0", "off-s1", "off-s2"):
        write_run(tmp_path / "runs", name, int(name[-1]), False, rng)
        rows.append(dict(json.loads((tmp_path / "runs" / name / "summary.json").read_text()), arm="off",
                         flags="--fix off", log_kept=True, lr=1e-3))
    (tmp_path / "runs/off-s0/config.json").write_text("{")   # damaged
    log = tmp_path / "runs/off-s2/log.csv"
    lines = [{k: ("" if k == "val_loss" or k.startswith("max_logit") else v) for k, v in line.items()}
             for line in csv.DictReader(open(log))]
    write_csv(log, lines, list(lines[0]))
    write_csv(tmp_path / "runs.csv", rows, list(rows[0]))
    table = analyze.loss_table(analyze.table_rows([tmp_path / "runs.csv"]))
    assert "runs/off-s0: left out" in capsys.readouterr().out
    assert [line.split(" | ")[0] for line in table[2:]] == ["| `off-s1` (`--fix off`)", "| `off-s2` (`--fix off`)"]
    assert table[2].split(" | ")[3] == f"{4.1 - 350 / 200:.3f} (350)"
    assert table[3].endswith(" | - | - |")


def peak_of(run):
    return max(float(r["max_logit_L0"]) for r in csv.DictReader(open(run / "log.csv")) if r["max_logit_L0"])


def test_a_killed_run_is_counted_as_stopped(tmp_path):
    """A run without summary.json (killed), or whose log goes on past it (resumed, then killed), stopped before its
    end: neither a collapse nor a run that trained through. One whose lock a live process holds is still running."""
    rng = np.random.default_rng(0)
    write_run(tmp_path, "done-s0", 0, False, rng)
    write_run(tmp_path, "killed-s1", 1, False, rng)
    (tmp_path / "killed-s1" / "summary.json").unlink()
    write_run(tmp_path, "resumed-s2", 2, False, rng)
    summary = tmp_path / "resumed-s2" / "summary.json"
    summary.write_text(json.dumps(json.loads(summary.read_text()) | dict(steps=200)))   # its first leg's
    write_run(tmp_path, "live-s3", 3, False, rng)
    (tmp_path / "live-s3" / "summary.json").unlink()
    (tmp_path / "live-s3" / "lock").write_text(str(os.getpid()))
    write_run(tmp_path, "fell-s4", 4, True, rng)
    runs = [load_run(p) for p in sorted(tmp_path.iterdir())]
    assert [run.ended for run in runs] == ["finished", "collapsed", "stopped", "running", "stopped"]
    words = analyze.group_outcome(runs)
    assert words == ("5 runs: 1 collapsed at step 300; 1 without a collapse in 390 steps; 2 stopped at step 390, "
                     "before their end (killed); 1 still running (step 390)")
    rates = analyze.arm_rates(runs)[0]
    assert (rates["collapsed"], rates["ended"], rates["runs"]) == (1, 2, 5)


def test_a_layer_is_named_only_where_it_stands_out(tmp_path):
    """A short run's W_Q grows alike in every layer, as it learns: the report names no layer."""
    rng = np.random.default_rng(0)
    write_run(tmp_path / "runs", "off-s0", 0, False, rng)   # every layer's W_Q grows 1.39x
    analyze.main([str(tmp_path / "runs")])
    report = (tmp_path / "runs" / "figures" / "report.md").read_text()
    assert "**layer" not in report and "No layer stands out" in report
    assert analyze.stands_out(0, {0: 349, 1: 8.2}) and not analyze.stands_out(1, {0: 1.8, 1: 2.1})
    assert not analyze.stands_out(0, {0: 5.0})   # one layer: nothing to stand out from


def refused(argv, capsys):
    """analyze.main's refusal of argv: exit status 2; what it wrote on stderr."""
    with pytest.raises(SystemExit) as exited:
        analyze.main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_missing_folder_is_named(tmp_path, monkeypatch, capsys):
    """One line on stderr and exit status 2, as argparse (and train.py) refuse a command."""
    monkeypatch.chdir(tmp_path)
    for argv, missing in ((["nosuchdir"], "nosuchdir"), ([], "runs"), (["--table", "no.csv"], "no.csv")):
        assert refused(argv, capsys) == f"analyze.py: error: no such file or folder: {missing}\n"
    (tmp_path / "empty").mkdir()
    assert refused(["empty"], capsys) == "analyze.py: error: no run folders (with a log.csv or log.csv.gz) in empty\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]   # nothing written
    (tmp_path / "README.md").write_text("# not a table\n")
    assert refused(["--table", "README.md", "empty"], capsys) == (
        "analyze.py: error: not a study's runs.csv (a CSV with columns name, arm and flags): README.md, empty\n")
    (tmp_path / "runs.csv").write_text("name,arm,flags\n")
    assert refused(["--table", "runs.csv"], capsys).startswith("analyze.py: error: no block of runs.csv in README.md")


def test_a_run_without_a_log_row_is_left_out_and_paths_may_mix(tmp_path, monkeypatch, capsys):
    """A run stopped before its first log row (train.py writes log.csv's header at its start) is named in one line
    and left out; run folders given as relative and absolute paths are one set of runs."""
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    write_run(Path("runs"), "off-s0", 0, False, rng)
    write_run(tmp_path / "more", "off-s1", 1, False, rng)
    (tmp_path / "more" / "new").mkdir()
    (tmp_path / "more" / "new" / "log.csv").write_text(",".join(columns()) + "\n")
    (tmp_path / "more" / "new" / "config.json").write_text((tmp_path / "more" / "off-s1" / "config.json").read_text())
    (tmp_path / "more" / "bare").mkdir()   # a log of a run whose settings were not kept: no arm can be told
    (tmp_path / "more" / "bare" / "log.csv").write_text((tmp_path / "more" / "off-s1" / "log.csv").read_text())
    analyze.main(["runs", str(tmp_path / "more")])
    out = capsys.readouterr().out
    assert f"{tmp_path / 'more' / 'new'}: left out, its log has no row yet" in out
    assert f"{tmp_path / 'more' / 'bare'}: left out, it has no config.json: its settings are unknown" in out
    report = (tmp_path / "figures" / "report.md").read_text()
    assert "off-s0" in report and "off-s1" in report and "new" not in report and "bare" not in report


def test_a_table_takes_no_runs_and_no_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("runs.csv").write_text("name,arm,flags,log_kept\n")
    assert refused(["runs", "--table", "runs.csv"], capsys) == "analyze.py: error: --table reads no runs\n"
    assert refused(["--table", "runs.csv", "--out", "x"], capsys) == \
        "analyze.py: error: --table writes the docs' tables in place: no --out\n"


def test_no_readable_run_or_an_out_that_is_a_file_is_one_line(tmp_path, capsys):
    rng = np.random.default_rng(0)
    write_run(tmp_path / "runs", "off-s0", 0, False, rng)
    (tmp_path / "report.md").write_text("a file\n")
    assert refused([str(tmp_path / "runs"), "--out", str(tmp_path / "report.md")], capsys) == (
        f"analyze.py: error: --out must be a folder: cannot make {tmp_path / 'report.md'} (File exists)\n")
    (tmp_path / "runs" / "off-s0" / "summary.json").write_text("[1]")   # JSON, but not a summary: left out
    assert refused([str(tmp_path / "runs")], capsys) == (
        f"analyze.py: error: no readable runs in {tmp_path / 'runs'}: every one was left out\n")
    assert not (tmp_path / "runs" / "figures").exists()


def test_a_table_that_cannot_be_read_or_misses_a_kept_log_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    header = b"name,arm,flags,log_kept\n"   # (is_runs_table reads it; read_table, the rest)
    for rest in (b"on-s0,on,--fix on,\n" * 1000 + b"\xff\n", b"on-s0,on\n"):   # not UTF-8 text; a row cut short
        Path("runs.csv").write_bytes(header + rest)
        error = refused(["--table", "runs.csv"], capsys)
        assert error.startswith("analyze.py: error: runs.csv") and error.count("\n") == 1   # read_table's line
    Path("runs.csv").write_text("name,arm,flags,log_kept\non-s0,on,--fix on,False\n")   # whole rows, too few columns
    assert refused(["--table", "runs.csv"], capsys).startswith(
        "analyze.py: error: runs.csv is not a study's runs.csv: no column seed, lr, steps, collapsed, collapse_step")
    Path("runs.csv").write_text(f"{','.join(STUDY_COLUMNS)}\non-s0,on,--fix on,0,0.001,100,False,,True\n")
    assert refused(["--table", "runs.csv"], capsys) == (   # the columns the tables read besides
        "analyze.py: error: runs.csv is not a study's runs.csv: no column minutes, collapse_minute, max_logit\n")
    Path("runs.csv").write_text(f"{','.join(analyze.TABLE_COLUMNS)}\n"
                                "on-s0,on,--fix on,0,0.001,100,False,,True,1.5,,50\n")
    assert refused(["--table", "runs.csv"], capsys) == (
        f"analyze.py: error: runs.csv says these runs' logs are kept, but there is none in {Path('runs', 'on-s0')}\n")
    assert refused(["--table", "runs.csv", "./runs.csv"], capsys) == (
        "analyze.py: error: a table given twice would count its runs twice: runs.csv\n")


def test_a_block_of_the_kernel_as_it_ships_without_such_a_run_is_one_line(capsys):
    """README's table, its commands and the by-lr table are of the kernel as it ships: rows with none (a study of
    earlier kernels) are refused in one line, not a traceback or a table of headers alone."""
    rows = analyze.table_rows([Path(analyze.__file__).parent / "results/paper_precision/runs.csv"])
    assert rows and not any(as_shipped(row) for row in rows)
    for block in ("table", "commands", "by lr"):
        with pytest.raises(SystemExit) as exited:
            analyze.BLOCKS[block](rows)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1 and "as it ships among these tables' rows" in err


def test_mechanism_reads_no_runs(tmp_path):
    write_run(tmp_path / "runs", "off-s0", 0, False, np.random.default_rng(0))
    with pytest.raises(SystemExit):
        analyze.main(["--mechanism", str(tmp_path / "runs")])


def test_arm_rates(tmp_path):
    """The per-arm table, in report.md and rates.csv: two arms, one collapsed run. The summaries' values are chosen
    so that each median differs from the mean (steps from the log's last, 390, on: a summary short of its log is
    one of a run resumed and killed since); --fix off's max logits come from its logs."""
    rng = np.random.default_rng(0)
    runs = tmp_path / "runs"
    seeds = [("off", 0, True, dict(steps=400, tokens_per_s=4000.0, final_val_loss=9.0)),
             ("off", 1, False, dict(steps=600, tokens_per_s=5000.0, final_val_loss=2.0)),
             ("off", 2, False, dict(steps=450, tokens_per_s=9000.0, final_val_loss=2.5)),
             ("on", 0, False, dict(steps=400, tokens_per_s=6000.0, final_val_loss=2.2, max_logit=20.0)),
             ("on", 1, False, dict(steps=500, tokens_per_s=7000.0, final_val_loss=2.4, max_logit=30.0))]
    max_logits = []
    for fix, seed, collapse, values in seeds:
        rows = write_run(runs, f"{fix}-s{seed}", seed, collapse, rng, fix=fix)
        summary = runs / f"{fix}-s{seed}" / "summary.json"
        summary.write_text(json.dumps(json.loads(summary.read_text()) | values))
        if fix == "off":
            max_logits.append(max(r[f"max_logit_L{i}"] for r in rows for i in range(N_LAYER)
                                  if r[f"max_logit_L{i}"] != ""))
    assert max_logits[0] > max_logits[1] == max_logits[2]  # the collapsing run's grow: median != mean

    analyze.main([str(runs)])

    report = (runs / "figures" / "report.md").read_text()
    minutes = COLLAPSE_STEP * 1.5 / 60
    assert (f"| `--preset tiny --fix off` | 1/3 | 0 | {minutes:.1f} | 450 | 2.5000 | {max_logits[1]:.4g} | 5,000 "
            "| - |" in report)
    assert "| `--preset tiny --fix on` | 0/2 | 0 | - | 450 | 2.3000 | 25 | 6,500 | - |" in report  # no fp32 arm
    with open(runs / "figures" / "rates.csv", newline="") as f:
        rates = list(csv.DictReader(f))
    assert [(r["arm"], r["collapsed"], r["ended"], r["runs"], r["median_collapse_minute"]) for r in rates] == [
        ("--preset tiny --fix off", "1", "3", "3", str(minutes)), ("--preset tiny --fix on", "0", "2", "2", "")]
    numbers = [float(r[f"median_{key}"]) for r in rates
               for key in ("steps", "final_val_loss", "max_logit", "tokens_per_s")]
    assert numbers == pytest.approx([450, 2.5, max_logits[1], 5000, 450, 2.3, 25, 6500], rel=1e-5)


def test_val_loss_against_fp32_at_the_same_step(tmp_path):
    """An arm's median val loss over the fp32 arm's, at the last step every run logged."""
    def run(name, attn, last, loss_at_300):
        step = np.arange(100.0, last + 1, 100.0)
        val = np.where(step == 300, loss_at_300, 3.0)
        return Run(tmp_path / name, dict(attn=attn, fix="on", exponent="fma", seed=0), {},
                   {"step": step, "val_loss": val})
    on = [run("on-a", "kernel", 300, 2.0), run("on-b", "kernel", 400, 2.2)]
    fp32 = [run("fp32-a", "fp32", 500, 2.0)]
    assert analyze.val_loss_vs(on, fp32) == (300, pytest.approx(2.1 / 2.0))
    odd = Run(tmp_path / "odd", dict(attn="fp32", seed=0), {}, {"step": np.array([150.0, 450.0]),
                                                                 "val_loss": np.array([2.0, 2.0])})
    assert analyze.val_loss_vs(on, [odd]) == (None, None)  # no step that every run logged
    short = Run(tmp_path / "short", dict(attn="fp32", seed=0), {}, {"step": np.array([100.0, 200.0, 250.0]),
                                                                     "val_loss": np.array([2.0, 2.5, 2.0])})
    assert analyze.val_loss_vs(on, [short]) == (200, pytest.approx(3.0 / 2.5))  # its final step 250 is its own
    rows = analyze.arm_rates(on + fp32)
    assert [(r["arm"], r["runs"], r["val_step"]) for r in rows] == [("--fix on", 2, 300), ("--attn fp32", 1, 500)]
    assert rows[0]["val_loss_vs_fp32"] == pytest.approx(2.1 / 2.0) and rows[1]["val_loss_vs_fp32"] == 1.0
    # each arm against the fp32 arm trained alike (its lr), whichever comes first: none where none was
    high = Run(tmp_path / "fp32-lr", dict(attn="fp32", fix="on", seed=0, lr=1e-2), {},
               {"step": np.array([100.0, 200.0, 300.0]), "val_loss": np.array([4.0, 4.0, 4.0])})
    fast = Run(tmp_path / "on-lr", dict(attn="kernel", fix="on", exponent="fma", seed=0, lr=3e-3), {},
               {"step": np.array([100.0, 200.0, 300.0]), "val_loss": np.array([2.0, 2.0, 2.0])})
    rows = {r["arm"]: r["val_loss_vs_fp32"] for r in analyze.arm_rates([high, *on, *fp32, fast])}
    assert rows["--fix on"] == pytest.approx(2.1 / 2.0) and rows["--attn fp32 --lr 1e-2"] == 1.0
    assert rows["--fix on --lr 3e-3"] is None


# -----------------------------------------------------------------------------
# Looks


def test_labels_and_colours(tmp_path):
    """Each arm its own shade of its family's colour, each seed its line style; labels name arms by flags, and the
    same arm and seed twice gets the folder names."""
    rng = np.random.default_rng(0)
    for name, seed, settings in (("off-s0", 0, {}), ("off-s1", 1, {}), ("b3-s0", 0, dict(mantissa_bits=3)),
                                 ("on-s0", 0, dict(fix="on")), ("paper-s0", 0, dict(fix="paper")),
                                 ("fp32-s0", 0, dict(attn="fp32")), ("dfp32-s0", 0, dict(delta="fp32-o")),
                                 ("dp-s0", 0, dict(delta_from_p=True))):   # (dp-s0: an older run's spelling)
        write_run(tmp_path, name, seed, False, rng, **settings)
    write_run(tmp_path / "again", "off-s0", 0, False, rng)
    runs = [load_run(p) for p in sorted(tmp_path.iterdir()) if p.name != "again"] + [
        load_run(tmp_path / "again" / "off-s0")]
    styles = run_styles(runs, {r.path: analyze.arm(r) for r in runs})
    style = {(r.path.parent.name, r.name): styles[r.path] for r in runs}
    at = lambda name: style[tmp_path.name, name]  # noqa: E731
    assert at("off-s1")["label"] == "--preset tiny --fix off, seed 1"
    assert at("off-s0")["label"] == f"--preset tiny --fix off, seed 0 ({tmp_path.name}/off-s0)"
    assert style["again", "off-s0"]["linestyle"] != at("off-s0")["linestyle"]  # twins look different
    assert len({s["label"] for s in style.values()}) == len({(s["color"], str(s["linestyle"]))
                                                             for s in style.values()}) == len(runs)
    for name, family in (("on-s0", "fix on"), ("paper-s0", "fix paper"), ("fp32-s0", "fp32"),
                         ("dfp32-s0", "delta from fp32 O"), ("dp-s0", "delta from P"), ("off-s0", "fix off")):
        assert at(name)["color"] in PALETTE[family], name
    assert at("b3-s0")["color"] != at("off-s0")["color"] == at("off-s1")["color"]  # same family, another arm
    assert at("off-s0")["linestyle"] != at("off-s1")["linestyle"]


def test_grid_panels_keep_step_labels_apart(tmp_path, monkeypatch):
    """Runs 120,000 steps long in a narrow panel: at most 5 step labels, so six-digit numbers do not run together."""
    rng = np.random.default_rng(0)
    write_run(tmp_path, "long", 0, False, rng)
    run = load_run(tmp_path / "long")
    run.log["step"] = run.log["step"] * 300  # 0 .. 117,000
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig))
    plots.plot_grid([run], run_styles([run], {run.path: "a"}), [["sn_q_L0", "sn_q_L1"]], "t", "y", tmp_path / "g.png")
    for ax in figures[0].axes:
        lo, hi = ax.get_xlim()
        assert 2 <= sum(lo <= t <= hi for t in ax.get_xticks()) <= 5


@pytest.mark.parametrize("last, labels", [(400, ["0", "100", "200", "300", "400"]),
                                          (5000, ["0", "1,000", "2,000", "3,000", "4,000", "5,000"]),
                                          (150_000, ["0", "50k", "100k", "150k"])])
def test_step_labels_read_as_steps(last, labels):
    """50k on a long axis, 1,000 on a short one; never 0.05k."""
    fig, ax = plt.subplots()
    ax.plot([0, last], [0, 1])
    ax.set_xlim(0, last)
    ax.set_xticks(np.linspace(0, last, len(labels)))
    plots.step_axis(ax.xaxis)
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == labels
    plt.close(fig)


def test_minutes_alone_borrow_the_pace_of_the_same_block_only():
    """An arm none of whose runs had the GPU alone takes the pace of the runs of its attention and block that did: a
    run of another block (QK-norm, slower a step), of another model size or of a patched kernel lends it none."""
    row = lambda name, flags, steps, minutes, **block: dict(
        name=name, arm=name, flags=flags, seed=0, attn="kernel", collapsed=False, collapse_step=None,
        collapse_minute=None, steps=steps, minutes=minutes, exponent="fma", **(dict(pos="learned", qk_norm=False)
                                                                             | block))
    rows = [row("off", "--fix off", 10_000, 2.0), row("on", "--fix on", 100_000, 10.0),
            row("qk-off", "--fix off --qk-norm", 18_000, 4.0, qk_norm=True),
            row("qk", "--fix on --qk-norm", 90_000, 10.0, qk_norm=True),
            row("small", "--fix on --n-layer 2", 300_000, 10.0, n_layer=2),
            row("patched", "--fix on", 300_000, 10.0, variant="a patched kernel")]
    minutes = {r["name"]: analyze.alone_minutes([r], analyze.kin_of([r], rows)) for r in rows}
    assert minutes == {"off": [1.0], "on": [10.0], "qk-off": [2.0], "qk": [10.0], "small": [10.0],
                       "patched": [10.0]}   # (not 18,000 / 9,500, nor 10,000 / 30,000 a minute)


def test_study_table_keeps_the_earlier_kernels_runs_apart():
    """An arm whose runs span the kernel's change (the earlier ones record no exponent): two lines, as the
    figures' legend has them, not one median over both kernels."""
    rows = [dict(name=f"paper-s{s}", arm="paper", flags="--fix paper", seed=s, attn="kernel", collapsed=True,
                 collapse_step=step, collapse_minute=step / 10_000, steps=step, minutes=step / 10_000, max_logit=1e9,
                 log_kept=False, exponent=exponent)
            for s, step, exponent in ((0, 70_000, None), (1, 120_000, None), (2, 65_000, "fma"))]
    rows.append(dict(rows[0], name="fp32-s0", arm="fp32", flags="--attn fp32", attn="fp32", collapsed=False))
    lines = analyze.study_table(rows)
    assert [line.split(" | ")[:5] for line in lines[2:5]] == [
        ["| `paper` (before --exponent)", "`python train.py --fix paper`", "2 (0, 1)", "0", "**2 / 2**"],
        ["| `paper`", "`python train.py --fix paper`", "1 (2)", "0", "**1 / 1**"],
        ["| `fp32`", "`python train.py --attn fp32`", "1 (0)", "0", "**0 / 1**"]]   # (no kernel: no exponent)


def test_study_table_counts_collapses_per_arm(tmp_path):
    rows = [dict(name=f"off-s{s}-nolog", arm="off", flags="--fix off", seed=s, collapsed=True, collapse_step=step,
                 collapse_minute=minute, steps=step, minutes=minute, tokens_per_s=speed, max_logit=logit,
                 log_kept=False, exponent="fma")
            for s, step, minute, speed, logit in ((0, 10_000, 1.0, 3e6, 1e9), (1, 30_000, 6.0, 1.5e6, 2e6))]
    rows.append(dict(name="on-s0", arm="on", flags="--fix on", seed=0, collapsed=False, collapse_step=None,
                     collapse_minute=None, steps=500, minutes=1.0, tokens_per_s=3e6, max_logit=120.0, log_kept=False,
                     exponent=None))
    rows += [dict(name=f"sdpa-s{s}-nolog", arm="sdpa", flags="--attn sdpa", seed=s, collapsed=False,
                  collapse_step=None, collapse_minute=None, steps=400, tokens_per_s=3e6, max_logit=logit,
                  log_kept=False) for s, logit in ((0, 3e5), (1, None))]
    lines = analyze.study_table(rows)
    assert lines[2] == "| `off` | `python train.py --fix off` | 2 (0, 1) | 0 | **2 / 2** | 20,000 (10,000-30,000) | - " \
                       "| 3.5 (1.0-6.0) | 5.01e+08 (2e+06-1e+09) | - |"
    assert lines[3] == "| `on` | `python train.py --fix on` | 1 (0) | 0 | **0 / 1** | - | 500 | - | 120 | - |"
    assert lines[4] == "| `sdpa` | `python train.py --attn sdpa` | 2 (0, 1) | 0 | **0 / 2** | - | 400 | - | 3e+05 | - |"
    # an arm without a collapse whose logits ran away is said so
    assert lines[6] == ("No collapse is not no runaway: the max logit passed 10,000 in 1 of the 2 runs of `sdpa`, "
                        "which ended at the steps above before a collapse; the other arms without a collapse peak "
                        "at 120.")
    # one run had the GPU alone: 10,000 steps a minute, so the collapses come after 1 and 3 minutes
    assert lines[-1] == "Alone on one H200 the fix-off runs of `off` would collapse after 2.0 (1.0-3.0) minutes " \
                        "(alone_minutes)."
    # README's table: the rows that record the exponent (on-s0 does not; sdpa's neither), one line per command
    shipped = analyze.shipped_table(rows)
    assert shipped[2:] == ["| `python train.py --fix off` | 2 (0, 1) | **2 / 2** | 20,000 (10,000-30,000) "
                           "| 2.0 (1.0-3.0) | - |", "", shipped[-1]]
    assert shipped[-1].startswith("Each number is the median of the runs (of two, their midpoint), the range in "
                                  "brackets. Minutes alone: a run's own")
    # (the comments start one space after the longest command: here the only one)
    assert analyze.run_lines(rows) == ["    python train.py --fix off # collapsed on 2 of 2 seeds, "
                                       "1.0-3.0 min alone on an H200"]


def test_headline_hues_are_one_per_arm():
    """Each family's own colour goes to its first arm, even where an earlier arm of a crowded family needs a spare;
    no two arms share a hue."""
    hues = plots.arm_hues({"off": "fix off", "flash": "sdpa", "cudnn": "sdpa", "on": "fix on", "on2": "fix on"})
    assert (hues["off"], hues["flash"], hues["on"]) == ("tab:red", "dimgray", "tab:blue")
    assert len(set(hues.values())) == 5
    crowded = plots.arm_hues({f"off{i}": "fix off" for i in range(len(plots.HUES) + 2)})   # more arms than hues
    assert list(crowded.values())[1:] == (plots.HUES[1:] * 2)[:len(plots.HUES) + 1]   # the spares again, in order


def test_the_committed_probe_tables_pool_the_committed_runs():
    """results/delta_probe's probe_phases.csv is the pooling of the run folders its regenerate command (in
    results/README.md) names, as they are committed: a run added or replaced since it was written shows here."""
    root = Path(analyze.__file__).resolve().parent
    command = re.search(r"`python analyze\.py --probe ([^`]+) --out results/delta_probe`",
                        (root / "results" / "README.md").read_text())
    assert command, "results/README.md names no command for results/delta_probe's tables"
    runs = [run for run in load_runs(find_runs([root / p for p in command.group(1).split()]))
            if run.series(probe.column("total")) is not None]
    with open(root / "results" / "delta_probe" / "probe_phases.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    pooled = probe.pooled_phases(runs, analyze.arm)
    assert rows and [(r["arm"], r["probe_batches"], r["phase"], r["term"]) for r in rows] == \
           [(p["arm"], p["probe_batches"], str(p["phase"]), p["term"]) for p in pooled]
    for row, new in zip(rows, pooled):
        assert [int(row[c]) for c in ("checkpoints", "runs", "first_step", "last_step")] == \
               [new[c] for c in ("checkpoints", "runs", "first_step", "last_step")], row
        assert float(row["mean"]) == pytest.approx(new["mean"], rel=1e-4), row
        assert float(row["se"]) == pytest.approx(new["se"], rel=1e-4), row
        assert float(row["t"]) == pytest.approx(new["t"], rel=1e-4, abs=1e-4), row


def test_readme_order_puts_the_fix_off_then_on_first():
    """README's table and commands open with the two commands it is about, whatever order the studies ran in."""
    rows = [dict(arm=arm, flags=flags) for arm, flags in (("fp32", "--attn fp32"), ("on", "--fix on"),
                                                          ("off", "--fix off"), ("paper", "--fix paper"))]
    assert list(analyze.readme_order(analyze.rows_by_arm(rows))) == ["off", "on", "fp32", "paper"]
