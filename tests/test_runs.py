"""nanolp/runs.py: the git state a run records (train.py records the rest: tests/test_train.py), what a log says
of its run, and a run recorded in older spellings read in today's (nanolp/runconfig.py's as_current), every
committed one among them; a study's table cut short refused."""

import importlib
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from nanolp import runconfig, runs


def test_git_state_outside_a_checkout(tmp_path):
    assert runs.git_state(tmp_path) == (None, None)
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "f").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "f"], check=True)
    commit, dirty = runs.git_state(tmp_path)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "f").write_text("b")
    assert runs.git_state(tmp_path) == (commit, True)


def test_log_outcome_reads_a_log_as_train_py_summarises_it(tmp_path):
    (tmp_path / "log.csv").write_text(
        "step,elapsed_s,train_loss,val_loss,tokens_per_s,max_logit_L0,max_logit_L1\n"
        "10,6,3.0,2.9,100,,\n20,12,2.0,,300,5.0,7.5\n30,18,nan,,200,,\n")
    outcome = runs.log_outcome(runs.read_log(tmp_path / "log.csv"))
    assert outcome == dict(steps=30, minutes=0.3, final_val_loss=2.9, final_train_loss=None,  # ended non-finite
                           max_logit=7.5, tokens_per_s=200.0)
    (tmp_path / "summary.json").write_text('{"steps": 40, "final_val_loss": null}')
    run = runs.load_run(tmp_path)   # the summary's values where it has them, the log's elsewhere
    assert run.outcome["steps"] == 40 and run.outcome["final_val_loss"] == 2.9 and run.outcome["max_logit"] == 7.5


def test_a_config_in_the_older_spellings_loads_in_todays(tmp_path):
    """A committed run's config.json, as train.py wrote it before delta and precision took today's spellings and
    before --qk-norm, loads in today's: delta_from_p / delta_fp32 as the one setting delta, precision "paper" as
    "autocast", the block it ran (GPT-2's) as today's settings of it; the file itself is left as it was."""
    committed = Path(__file__).resolve().parents[1] / "results" / "seed_study" / "runs" / "paper-fp32-o-s0" / "config.json"
    original = json.loads(committed.read_text())
    assert original["delta_from_p"] is False and original["delta_fp32"] is True and "delta" not in original
    assert "qk_norm" not in original
    loaded = runconfig.read_json(committed)
    assert (loaded["fix"], loaded["precision"], loaded["delta"], loaded["stochastic_o"]) == (
        "paper", "fa2", "fp32-o", "off")
    assert loaded == {k: v for k, v in original.items() if k not in ("delta_from_p", "delta_fp32")} | dict(
        delta="fp32-o", qk_norm=False)
    for old, new in ((dict(precision="paper", delta_from_p=True), dict(precision="autocast", delta="p")),
                     (dict(delta_from_p=False), dict(delta="o"))):
        (tmp_path / "config.json").write_text(json.dumps(original | dict(delta_fp32=False) | old))
        loaded = runconfig.read_json(tmp_path / "config.json")
        assert "delta_from_p" not in loaded and "delta_fp32" not in loaded
        assert {k: loaded[k] for k in ("fix", "precision", "delta", "stochastic_o")} == {
            k: new.get(k, original.get(k, "o")) for k in ("fix", "precision", "delta", "stochastic_o")}, old
        # today's come back unchanged
        assert runconfig.read_json(tmp_path / "config.json") == runconfig.as_current(loaded)
    assert json.loads(committed.read_text()) == original


def test_every_committed_run_reads_in_todays_spellings():
    """Every config.json, summary.json and runs.csv row under results/ reads in today's spellings: no key or value
    that as_current translates is left, and a run's settings have the block's."""
    root = Path(__file__).resolve().parents[1] / "results"
    files = sorted(root.glob("*/runs/*/config.json")) + sorted(root.glob("*/runs/*/summary.json"))
    settings = [runconfig.read_json(path) for path in files]
    settings += [row for table in sorted(root.glob("**/runs.csv")) for row in runs.read_table(table)]
    assert len(files) >= 40 and len(settings) > len(files)
    for s in settings:
        assert not {"delta_from_p", "delta_fp32"} & s.keys() and s.get("precision") != "paper", s.get("name")
        assert "--delta-from-p" not in (s.get("flags") or "") and "--precision paper" not in (s.get("flags") or "")
        assert "attn" not in s or set(runconfig.GPT2_BLOCK) <= s.keys()


def test_a_table_without_the_block_options_reads_as_gpt2s_block(tmp_path):
    """A study's runs.csv written before --pos and --qk-norm reads its runs as GPT-2's block; today's rows keep
    their block, and a table of something other than runs (no attn column) gains no columns."""
    (tmp_path / "runs.csv").write_text("name,attn,fix\nold,kernel,off\n")
    (tmp_path / "new.csv").write_text("name,attn,pos,qk_norm\nr,kernel,rope,False\nq,kernel,learned,True\n")
    (tmp_path / "probe.csv").write_text("arm,total\noff,1.5\n")
    assert runs.read_table(tmp_path / "runs.csv") == [dict(name="old", attn="kernel", fix="off", pos="learned",
                                                           qk_norm=False)]
    assert [(r["pos"], r["qk_norm"]) for r in runs.read_table(tmp_path / "new.csv")] == [("rope", False),
                                                                                          ("learned", True)]
    assert runs.read_table(tmp_path / "probe.csv") == [dict(arm="off", total=1.5)]


def test_a_table_cut_short_is_refused_naming_its_line(tmp_path):
    """A runs.csv whose last row lost its last cells (a copy cut short) is refused, naming the file and the line,
    rather than read with those cells empty (analyze.py --table would write its numbers into README.md)."""
    committed = Path(__file__).resolve().parents[1] / "results" / "seed_study" / "runs.csv"
    table = tmp_path / "runs.csv"
    table.write_bytes(committed.read_bytes()[:-8])
    lines = len(committed.read_text().splitlines())
    with pytest.raises(ValueError, match=rf"^{re.escape(str(table))}, line {lines}: \d+ cells where the header has "
                                         rf"\d+ \(the file cut short"):
        runs.read_table(table)
    table.write_bytes(b"name,arm\nr,\xff\n")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(table))} is not UTF-8 text"):
        runs.read_table(table)
    table.write_text("name,arm\n\nr,off\n")   # a blank line is no row, as csv.DictReader reads it
    assert runs.read_table(table) == [dict(name="r", arm="off")]


@pytest.mark.parametrize("name, data", [("log.csv", b"step,train_loss\n1,\xff\xfe\n"),
                                         ("log.csv.gz", b"\x1f\x8b\x08\x00 not a gzip stream")])
def test_a_log_that_cannot_be_read_is_a_damaged_file(tmp_path, name, data):
    """A log that is not UTF-8 or not gzip is named as a damaged file (which load_runs leaves out), not a traceback."""
    (tmp_path / name).write_bytes(data)
    with pytest.raises(runconfig.DamagedFile, match=re.escape(f"{tmp_path / name} cannot be read (")):
        runs.read_log(tmp_path / name)


@pytest.mark.parametrize("damage", ["20,12", "garbage,row,1,2"])
def test_a_log_row_of_the_wrong_length_is_a_damaged_file(tmp_path, capsys, damage):
    """A log whose last row is cut short (a copy cut within it) or is not train.py's is named in one line and left
    out, not read as a run of the wrong length; a folder in the log's place too."""
    (tmp_path / "log.csv").write_text(f"step,elapsed_s,train_loss\n10,6,3.0\n{damage}\n")
    with pytest.raises(runconfig.DamagedFile, match=re.escape(f"{tmp_path / 'log.csv'}, line 3: ")):
        runs.read_log(tmp_path / "log.csv")
    assert runs.load_runs([tmp_path]) == [] and "left out" in capsys.readouterr().out
    (tmp_path / "log.csv").unlink()
    (tmp_path / "log.csv").mkdir()
    with pytest.raises(runconfig.DamagedFile, match="cannot be read"):
        runs.read_log(tmp_path / "log.csv")


@pytest.mark.parametrize("stray", ["step,elapsed_s,train_loss", ",7,3.0", "2.5e3,7,3.0"])
def test_a_log_row_without_a_step_number_is_a_damaged_file(tmp_path, stray):
    """A row whose step is no step number (the header written again, an empty cell) would give the run's steps
    wrong (or NaN, which no count takes): named in one line as a damaged file."""
    (tmp_path / "log.csv").write_text(f"step,elapsed_s,train_loss\n10,6,3.0\n{stray}\n")
    with pytest.raises(runconfig.DamagedFile, match=re.escape(f"{tmp_path / 'log.csv'}: a row whose step is ")):
        runs.read_log(tmp_path / "log.csv")


def test_a_study_run_that_cannot_be_read_counts_as_its_row(tmp_path):
    """study_runs gives a kept run whose files are damaged (or gone) as its runs.csv row alone, as for a run whose
    log was not kept: the study's counts keep it, and the figures, which need its log, leave it out."""
    (tmp_path / "runs.csv").write_text("name,arm,flags,seed,steps,collapsed,log_kept\n"
                                       "off-s0,off,--fix off,0,100,True,True\noff-s1,off,--fix off,1,100,True,True\n")
    (tmp_path / "runs" / "off-s0").mkdir(parents=True)
    (tmp_path / "runs" / "off-s0" / "summary.json").write_text('{"steps": 1')     # off-s1: no folder at all
    study = runs.study_runs(tmp_path / "runs.csv")
    assert [(run.path.name, run.log, run.summary["steps"]) for run in study] == [("off-s0", {}, 100), ("off-s1", {}, 100)]


def test_study_rows_refuse_what_would_count_wrong_in_one_line(tmp_path):
    """study_rows gives each row its study's folder and its run's, the name as written, and refuses in one line
    (ValueError) a table given twice (its runs counted twice), one without a study's columns, a row without a name,
    and one that says a log is kept where there is none."""
    header = ",".join(runs.STUDY_COLUMNS)
    table = tmp_path / "runs.csv"
    table.write_text(f"{header}\noff-s0,off,--fix off,0,0.001,100,True,90,False\n1e3,off,--fix off,0,0.001,100,True,"
                     "90,False\n")
    assert [(row["name"], row["folder"], row["run_dir"]) for row in runs.study_rows([table])] == [
        ("off-s0", tmp_path, tmp_path / "runs" / "off-s0"), ("1e3", tmp_path, tmp_path / "runs" / "1e3")]
    table.write_text(f"{header}\noff-s0,off,--fix off,0,0.001,100,True,90,False\n,off,--fix off,1,0.001,100,True,90,"
                     "True\n")
    with pytest.raises(ValueError, match=r"runs.csv, line 3: a run without a name$"):
        runs.study_rows([table])
    table.write_text(f"{header}\noff-s0,off,--fix off,0,0.001,100,True,90,False\n")
    with pytest.raises(ValueError, match="^a table given twice would count its runs twice: "):
        runs.study_rows([table, tmp_path / "." / "runs.csv"])
    (tmp_path / "bench.csv").write_text("name,arm,flags,seed\nx,y,,0\n")
    with pytest.raises(ValueError, match=r"bench.csv is not a study's runs.csv: no column lr, steps, collapsed, "):
        runs.study_rows([tmp_path / "bench.csv"])
    table.write_text(f"{header}\noff-s0,off,--fix off,0,0.001,100,True,90,True\n")   # its log kept: no folder
    with pytest.raises(ValueError, match=r"says these runs' logs are kept, but there is none in .*off-s0$"):
        runs.study_rows([table])


@pytest.mark.parametrize("command", ["train", "analyze", "experiments.sweep", "experiments.bench",
                                     "experiments.lr_curve", "experiments.corpus"])
def test_every_command_refuses_a_malformed_flag_in_one_line(command, capsys):
    """Each command's parser is nanolp.cli.Parser: a flag it does not know is refused in one line naming the command
    as it is run, exit status 2, where argparse would print its usage first."""
    main = importlib.import_module(command).main
    with pytest.raises(SystemExit) as exited:
        main((["results/lr_sweep/runs.csv"] if command == "experiments.lr_curve" else []) + ["--no-such-flag"])
    prog = f"{command}.py" if "." not in command else f"python -m {command}"
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{prog}: error: ") and err.count("\n") == 1 and "--no-such-flag" in err


def test_a_runs_flags_are_a_shell_command_that_gives_its_settings():
    """arm_flags: the flags that set a run apart from its preset, quoted where a value needs it, so that train.py's
    parser given them (as a shell splits them) gives back the run's settings."""
    from train import CHOICES, PRESETS
    recorded = dict(preset="corpus", attn="kernel", fix="on", lr=0.003, pos="rope", qk_norm=True,
                    data="/texts/my text's/input.txt")
    flags = runconfig.arm_flags(recorded, PRESETS)
    assert flags == "--preset corpus --fix on --pos rope --qk-norm --lr 3e-3 --data '/texts/my text'\"'\"'s/input.txt'"
    settings = runconfig.resolve_config(runconfig.parse_args(shlex.split(flags), PRESETS, CHOICES), PRESETS)
    assert {k: settings[k] for k in recorded} == recorded


def test_a_runs_numbers_are_spelt_as_the_studies_declare_them():
    """A float flag as results/studies.toml writes it (--lr 3e-3, not 0.003), so that one arm has one spelling
    whether its runs.csv row comes from the study's declaration or from its run's settings; the same number back."""
    cases = {3e-3: "3e-3", 1e-2: "1e-2", 3e-4: "3e-4", 2.5e-3: "2.5e-3", 0.95: "0.95", 1.0: "1", 100.0: "100", 0.0: "0"}
    assert {value: runconfig.number_text(value) for value in cases} == cases
    assert all(float(text) == value for value, text in cases.items())
    from experiments.sweep import STUDIES, load_study
    study = load_study(STUDIES, "lr_sweep")   # its rates, as declared
    rates = {flags[flags.index("--lr") + 1] for flags, _ in study.arms.values() if "--lr" in flags}
    assert rates == {"3e-4", "3e-3", "1e-2"} and all(runconfig.number_text(float(rate)) == rate for rate in rates)


def test_a_log_rows_last_line_without_its_end_is_left_out(tmp_path):
    """A run killed as it appended a row leaves the row without its line end: cut within its last cell it would read
    as a whole row with a wrong number (5.1e-09 as 5.1), cut sooner it would refuse the whole log. Left out, either
    way; a row with too few cells elsewhere is still refused."""
    from nanolp.runs import read_log
    log = tmp_path / "log.csv"
    whole = "step,train_loss,probe\r\n10,2.5,5.1e-09\r\n20,2.4,5.2e-09\r\n"
    for cut in (len(whole) - 5, len(whole) - 12):   # within the last cell; within the row
        log.write_text(whole[:cut])
        assert read_log(log)["step"].tolist() == [10.0] and read_log(log)["probe"].tolist() == [5.1e-09]
    log.write_text(whole)
    assert read_log(log)["step"].tolist() == [10.0, 20.0]
    log.write_text("step,train_loss,probe\r\n10,2.5\r\n20,2.4,5.2e-09\r\n")
    with pytest.raises(runs.DamagedFile, match="line 2: 2 cells where the header has 3"):
        read_log(log)
