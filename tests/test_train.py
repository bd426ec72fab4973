"""train.py end to end on the CPU: a tiny run learns and writes its run folder, with its provenance; the default name
tells every arm apart; --resume continues a run exactly and refuses to change its arm; a non-finite loss stops the
run cleanly and keeps the last good checkpoint. A command that cannot run (a bad setting or text, a folder holding a
result or a live run, a collapsed run to resume, a GPU preset without CUDA, a config.json edited out of what train.py
writes) is refused in one line per problem, exit status 2, before it writes anything; an attempt that stopped before
its first checkpoint is replaced."""
import csv
import json
import math
import os
import platform
import random
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest
import torch
import triton

import model
import train
from kernels import Numerics
from nanolp import data, runconfig, runs
from nanolp.diagnostics import diag_columns

OUTCOME = {"collapsed", "collapse_step", "collapse_minute", "reason", "steps", "minutes", "final_val_loss",
           "final_train_loss", "max_logit", "tokens_per_s", "mfu", "peak_mem_gb"}
TIMING = {"elapsed_s", "tokens_per_s", "mfu"}  # the only columns allowed to differ between identical runs


@pytest.fixture
def text(tmp_path, monkeypatch):
    """A small made-up text (and no $NANOLP_DATA, which would be part of every run's arm)."""
    monkeypatch.delenv("NANOLP_DATA", raising=False)
    monkeypatch.setattr(data, "DATA_DIR", tmp_path / "data")  # keep the token cache out of the repository
    rng = random.Random(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "good", "night", "sweet"]
    path = tmp_path / "words.txt"
    path.write_text(" ".join(rng.choice(words) for _ in range(8000)) + "\n")
    return path


@pytest.fixture
def run(tmp_path, text):
    """run(name, *flags) trains the tiny preset on the small text, returns the run folder (name None: the
    default name)."""
    def run(name, *flags):
        summary = train.main(["--preset", "tiny", "--attn", "sdpa", "--device", "cpu", "--data", str(text),
                              "--out", str(tmp_path / "runs"), *([] if name is None else ["--name", name]),
                              "--batch-size", "8", "--block-size", "32", "--log-interval", "10",
                              "--eval-interval", "20", "--diag-interval", "20", "--ckpt-interval", "20", *flags])
        return tmp_path / "runs" / summary["name"]
    return run


def test_the_next_step_names_analyze_py_from_where_the_run_was_started(run, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)   # (not the repository's root)
    run("elsewhere", "--steps", "2")
    analyze = Path(train.__file__).with_name("analyze.py")
    assert f"next: python {os.path.relpath(analyze)} {tmp_path / 'runs'}   (" in capsys.readouterr().out


def parse_args(argv):
    """train.py's command line, as its main reads it."""
    return runconfig.parse_args(argv, train.PRESETS, train.CHOICES)


def read_log(run_dir):
    with open(run_dir / "log.csv", newline="") as f:
        return list(csv.DictReader(f))


def refusal(capsys, command):
    """What command() says as it refuses to run, as argparse refuses a bad command line: exit status 2 and one
    line per problem on stderr (no traceback)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        command()
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err and all(line.startswith("train.py: error: ") for line in err.splitlines()), err
    return err


def test_smoke_run_learns_and_writes_its_folder(run, tmp_path, capsys):
    run_dir = run("smoke", "--steps", "60")
    out, err = capsys.readouterr()
    # the progress bar shows layer 0's max logit, the one that runs away; the end, a few plain lines, no JSON
    assert "max_logit_L0=" in err and "max_logit=" not in err
    peak = max(float(r["max_logit_L0"]) for r in read_log(run_dir) if r["max_logit_L0"])
    end = out.splitlines()[-5:]
    assert re.fullmatch(r"no collapse in 60 steps \(\d+\.\d training minutes\)", end[0])
    assert end[1] == train.TINY_NOTE   # at this size no collapse is expected: the run checks the pipeline
    assert end[2:] == [
        f"layer 0's max attention logit peaked at {peak:.4g}",
        f"run folder: {run_dir} (summary.json: the outcome and the arm; config.json: every setting)",
        f"next: python analyze.py {tmp_path / 'runs'}   (figures and report.md of the runs in {tmp_path / 'runs'}, "
        f"written to {tmp_path / 'runs' / 'figures'})"]
    rows = read_log(run_dir)
    assert list(rows[0]) == train.BASE_COLUMNS + diag_columns(2, 2)
    assert [int(r["step"]) for r in rows] == [10, 20, 30, 40, 50, 60]
    assert float(rows[-1]["train_loss"]) < float(rows[0]["train_loss"]) - 0.5
    assert all(r["val_loss"] and r["max_logit_L1"] and r["delta_err_L0_H1"] for r in rows if int(r["step"]) % 20 == 0)
    assert not rows[0]["val_loss"] and not rows[0]["sn_q_L0"]  # only every --eval/--diag-interval steps
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary) == OUTCOME | set(runconfig.ARM) | {"name", "data_sha1", "provenance"}
    assert summary["collapsed"] is False and summary["steps"] == 60 and summary["tokens_per_s"] > 0
    assert summary["final_val_loss"] == pytest.approx(float(rows[-1]["val_loss"]))
    config = json.loads((run_dir / "config.json").read_text())
    assert config["preset"] == "tiny" and config["n_embd"] == 64 and config["batch_size"] == 8
    assert sorted(p.name for p in (run_dir / "ckpt").iterdir()) == [
        "step_0000020.pt", "step_0000020.pt.sha256", "step_0000040.pt", "step_0000040.pt.sha256", "step_0000060.pt",
        "step_0000060.pt.sha256"]   # each checkpoint with its checksum, as sha256sum writes it
    assert (run_dir / "ckpt" / "step_0000060.pt.sha256").read_text() == (
        f"{runs.sha256(run_dir / 'ckpt' / 'step_0000060.pt')}  step_0000060.pt\n")


def test_a_stochastic_arm_trains_the_same_whatever_its_eval_and_diag_intervals(run):
    """--stochastic-o forward rounds with torch's generator; the evaluations and diagnostics, which draw from it too,
    do not move the training's stream: the same losses every 10 steps with diagnostics every 20 steps or every 60.
    (Checked here, on the CPU: on a GPU two runs of one command already differ in their last bits, a GPU's sums
    not being repeatable, so no GPU run can show it bit for bit.)"""
    losses = [[row["train_loss"] for row in read_log(run(f"every-{n}", "--attn", "emulate", "--stochastic-o", "forward",
                                                        "--steps", "60", "--eval-interval", str(n),
                                                        "--diag-interval", str(n)))]
              for n in (20, 60)]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_each_setting_of_the_attention_reaches_it(run):
    """train.py hands the run's fix and numerics to the attention: each of these trains to other losses than plain
    FlashAttention-2's, whose run repeats its own bit for bit (the emulation on the CPU, the kernel's rounding bit
    for bit). The exponent is not among them: its two forms differ by an ulp now and then, which so small a run
    may never carry into a loss (tests/test_kernels.py checks each form)."""
    losses = lambda name, *flags: [row["train_loss"] for row in read_log(run(name, "--attn", "emulate", "--steps", "20",
                                                                            *flags))]
    plain = losses("plain")
    assert losses("again") == plain and len(plain) == 2
    arms = {"on": ["--fix", "on"], "paper": ["--fix", "paper"], "fp32-o": ["--delta", "fp32-o"], "p": ["--delta", "p"],
            "stochastic-delta": ["--delta", "stochastic-o"], "stochastic-o": ["--stochastic-o", "forward"],
            "bits": ["--mantissa-bits", "3"], "vo": ["--mantissa-bits", "3", "--amplify", "vo"],
            "autocast": ["--precision", "autocast"]}
    trained = {name: losses(name, *flags) for name, flags in arms.items()}
    assert {name: trained[name] != plain for name in arms} == dict.fromkeys(arms, True)
    assert trained["vo"] != trained["bits"]   # (--amplify itself, not only the bits it comes with)


def test_summary_holds_the_arm(run):
    run_dir = run("arm", "--attn", "emulate", "--delta", "fp32-o", "--stochastic-o", "forward", "--lr", "0.002",
                  "--seed", "3", "--n-head", "4", "--steps", "20")
    config = json.loads((run_dir / "config.json").read_text())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert config["delta"] == "fp32-o" and config["stochastic_o"] == "forward"
    arm = dict(preset="tiny", attn="emulate", fix="off", precision="fa2", delta="fp32-o",
               stochastic_o="forward", mantissa_bits=0, amplify="p", exponent="fma", pos="learned", qk_norm=False, lr=0.002,
               warmup=20, beta1=0.9, beta2=0.95, weight_decay=0.0, grad_clip=1.0, n_layer=2, n_head=4, n_embd=64, block_size=32,
               batch_size=8, dtype="bf16", data=config["data"], seed=3)
    assert {k: summary[k] for k in runconfig.ARM} == arm and summary["name"] == "arm"
    assert summary["data_sha1"] == config["data_sha1"] and len(summary["data_sha1"]) == 40
    assert float(read_log(run_dir)[-1]["train_loss"]) < 4.0   # it trains


def default_name(tmp_path, *flags):
    return runconfig.resolve_config(parse_args([*flags, "--out", str(tmp_path / "runs")]), train.PRESETS)["name"]


def test_default_names_tell_arms_apart(tmp_path, text, monkeypatch):
    arms = [[], ["--fix", "on"], ["--fix", "paper"], ["--attn", "sdpa"], ["--seed", "1"], ["--preset", "tiny"],
            ["--precision", "autocast"], ["--delta", "p"], ["--delta", "fp32-o"], ["--stochastic-o", "forward"],
            ["--delta", "stochastic-o"], ["--mantissa-bits", "3"], ["--mantissa-bits", "3", "--amplify", "vo"],
            ["--pos", "none"], ["--lr", "3e-3"], ["--lr", "0.0030001"], ["--warmup", "50"], ["--n-layer", "4"],
            ["--n-head", "12"], ["--n-embd", "192"], ["--block-size", "128"], ["--batch-size", "32"],
            ["--dtype", "fp32", "--attn", "sdpa"], ["--data", str(text)], ["--pos", "rope"], ["--qk-norm"],
            ["--delta", "fp32-o", "--lr", "3e-3"]]
    names = [default_name(tmp_path, *flags) for flags in arms]
    assert len(set(names)) == len(names), names
    assert names[:3] == ["default-kernel-fixoff-s0", "default-kernel-fixon-s0", "default-kernel-fixpaper-s0"]
    assert names[8] == "default-kernel-fixoff-delta_fp32-o-s0"
    assert names[-1] == "default-kernel-fixoff-delta_fp32-o-lr0.003-s0"
    assert "-bits3-" in names[11] and "-data_words-" in names[23]
    assert names[24:26] == ["default-kernel-fixoff-pos_rope-s0", "default-kernel-fixoff-qk_norm-s0"]
    # the same settings, however spelled, and flags that do not change the arm: the same name
    assert {default_name(tmp_path, *flags) for flags in (
        [], ["--fix", "off"], ["--lr", "0.001"], ["--delta", "o"], ["--preset", "default", "--mantissa-bits", "0"],
        ["--steps", "10", "--minutes", "5", "--log-interval", "5", "--diag-interval", "7", "--compile", "off",
         "--device", "cpu"])} == {"default-kernel-fixoff-s0"}
    assert default_name(tmp_path, "--preset", "tiny", "--lr", "3e-3") == "tiny-kernel-fixoff-s0"  # tiny's own lr
    assert default_name(tmp_path, "--lr", "3e-3", "--delta", "fp32-o") == names[-1]
    monkeypatch.setenv("NANOLP_DATA", str(text))   # the text is part of the arm, however it is given
    assert default_name(tmp_path) == names[23]
    # a preset's own text: $NANOLP_DATA does not replace it, and --data naming it is the preset's arm
    corpus = train.PRESETS["corpus"]["data"]
    assert default_name(tmp_path, "--preset", "corpus") == "corpus-kernel-fixoff-s0"
    monkeypatch.delenv("NANOLP_DATA")
    assert default_name(tmp_path, "--preset", "corpus", "--data", corpus) == "corpus-kernel-fixoff-s0"
    assert default_name(tmp_path, "--preset", "corpus", "--data", str(text)) != "corpus-kernel-fixoff-s0"
    # past MAX_NAME characters: a hash of the settings, stable, and different for different settings
    long = [["--attn", "emulate"], ["--precision", "autocast"], ["--delta", "p"], ["--stochastic-o", "forward"],
            ["--mantissa-bits", "3"], ["--amplify", "vo"], ["--pos", "none"], ["--lr", "0.002"]]
    a, b = (default_name(tmp_path, *sum(groups, [])) for groups in (long, long[::-1]))
    assert len(a) <= runconfig.MAX_NAME and a == b and re.fullmatch(r"default-emulate-fixoff-[0-9a-f]{10}-s0", a)
    assert default_name(tmp_path, *sum(long, []), "--warmup", "10") != a


def test_resume_reproduces_an_uninterrupted_run(run, capsys):
    whole = run("whole", "--steps", "40")
    part = run("part", "--steps", "30")
    assert (part / "ckpt" / "step_0000030.pt").exists()  # a run saves its last step too, to resume from there
    assert "it is finished: no collapse in 30 steps" in refusal(capsys, lambda: run("part", "--steps", "30"))
    assert f"pass --resume to continue it, --name for a new run, or delete {part} to start it afresh" in refusal(
        capsys, lambda: run("part", "--steps", "40"))   # not yet at its --steps
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
    assert a["state"]["loss_min"] == b["state"]["loss_min"] == c["state"]["loss_min"] < math.inf   # the spike test's
    # the clock a checkpoint keeps counts its row's evaluation and diagnostics, as the uninterrupted run's next row
    assert a["state"]["elapsed"] > float(read_log(whole)[-1]["elapsed_s"]) > 0


def test_a_run_resumed_at_its_minutes_trains_no_step(run, monkeypatch, tmp_path):
    """Killed after its last checkpoint but before its summary, a run that had reached its --minutes resumes to
    write that summary, training no step more than it had."""
    def killed(*args, **kwargs):
        raise RuntimeError("killed")
    with monkeypatch.context() as patched:
        patched.setattr(runs, "write_summary", killed)
        with pytest.raises(RuntimeError, match="killed"):
            run("timed", "--steps", "1000", "--minutes", "1e-6")   # (ends after its first step)
    run_dir = tmp_path / "runs" / "timed"
    steps = [row["step"] for row in read_log(run_dir)]
    run("timed", "--steps", "1000", "--minutes", "1e-6", "--resume")
    assert steps == ["1"] and [row["step"] for row in read_log(run_dir)] == steps
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 1


# a flag of each kind that decides a run's numbers, with a value other than the tiny run's
ARM_CHANGES = [("--preset", "default"), ("--attn", "emulate"), ("--fix", "on"), ("--fix", "paper"), ("--seed", "1"),
               ("--precision", "autocast"), ("--delta", "p"), ("--delta", "fp32-o"), ("--stochastic-o", "forward"),
               ("--mantissa-bits", "3"), ("--amplify", "vo"), ("--exponent", "torch"), ("--pos", "none"),
               ("--qk-norm",), ("--lr", "0.01"), ("--warmup", "5"), ("--n-layer", "1"), ("--n-head", "4"), ("--n-embd", "32"),
               ("--block-size", "16"), ("--batch-size", "4"), ("--dtype", "fp32")]


def test_resume_refuses_to_change_the_arm(run, text, tmp_path, capsys):
    run_dir = run("r", "--steps", "20")
    config = json.loads((run_dir / "config.json").read_text())
    flagged = {"--" + k.replace("_", "-") for k in runconfig.ARM if k in vars(parse_args([]))}
    assert {change[0] for change in ARM_CHANGES} | {"--data"} == flagged   # every flag of the arm is tried
    for change in ARM_CHANGES:
        key = change[0][2:].replace("-", "_")
        new = vars(parse_args(list(change)))[key]
        assert f"{change[0]}: the run has {config[key]!r}, this command {new!r}" in refusal(
            capsys, lambda: run("r", "--steps", "40", "--resume", *change))
    other = tmp_path / "other.txt"
    other.write_text(text.read_text()[::-1])
    assert f"--data (or $NANOLP_DATA): the run has {str(text)!r}, this command {str(other)!r}" in refusal(
        capsys, lambda: run("r", "--steps", "40", "--resume", "--data", str(other)))
    text.write_text(text.read_text().upper())   # the same file, another text: another data order
    assert re.search("the text .*words.txt has changed since the run started",
                     refusal(capsys, lambda: run("r", "--steps", "40", "--resume")))
    assert json.loads((run_dir / "config.json").read_text()) == config   # nothing was touched
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20]


def test_a_config_json_is_checked_key_by_key(tmp_path):
    """A config.json as train.py writes it passes; a key it does not write, or a value of another type (a hand's
    edit), is named, one line each, with the file."""
    path = tmp_path / "config.json"
    written = train.PRESETS["tiny"] | dict(preset="tiny", name="r", device="cpu", compile="off", data=None,
                                           data_sha1="0" * 40, vocab_size=65, flops_per_token=10**6,
                                           attn_impl="emulate", provenance=dict(commit=None), forked_from="base@10")
    assert runconfig.config_problems(path, written, train.PRESETS) == []
    assert runconfig.config_problems(path, written | dict(lr=1, minutes=5, data="a.txt"), train.PRESETS) == []
    edited = written | dict(n_layer="two", n_embd=64.0, qk_norm=1, seed=None, minutes="5", steps=True, n_layers=3,
                            colour="red")
    assert runconfig.config_problems(path, edited, train.PRESETS) == [
        f'{path}: "n_layer" is "two", not an integer', f'{path}: "n_embd" is 64.0, not an integer',
        f'{path}: "qk_norm" is 1, not true or false', f'{path}: "seed" is null, not an integer',
        f'{path}: "steps" is true, not an integer', f'{path}: "minutes" is "5", not a number',
        f'{path}: unknown key "n_layers" (did you mean "n_layer"?)', f'{path}: unknown key "colour"']
    lost = {k: v for k, v in written.items() if k not in ("preset", "name")}   # (as_ran would fall back on them)
    assert runconfig.config_problems(path, lost, train.PRESETS) == [
        f'{path}: no "preset", which train.py records for every run', f'{path}: no "name", which train.py records '
        f'for every run']


def test_a_finished_run_says_so_and_how_to_start_it_afresh(run, capsys):
    done = run("done", "--steps", "20")
    assert f"{done}: it is finished: no collapse in 20 steps (summary.json); give a larger --steps" in refusal(
        capsys, lambda: run("done", "--steps", "20", "--resume"))
    assert f"it is finished: no collapse in 20 steps (summary.json): --resume with a larger --steps trains it " \
           f"further, --name starts a new run, or delete {done} to start it afresh" in refusal(
        capsys, lambda: run("done", "--steps", "20"))
    assert [int(r["step"]) for r in read_log(done)] == [10, 20]   # nothing was touched


def test_a_run_finished_by_its_minutes_says_to_give_more_minutes(run, capsys):
    """A run that ended at its --minutes is told to take a larger --minutes (a larger --steps would not train it)."""
    done = run("budget-done", "--steps", "1000", "--minutes", "1e-6")
    steps = json.loads((done / "summary.json").read_text())["steps"]
    assert steps < 1000
    said = refusal(capsys, lambda: run("budget-done", "--steps", "1000", "--minutes", "1e-6", "--resume"))
    assert f"it is finished: no collapse in {steps:,} steps (summary.json); give a larger --minutes to train it " \
           "further" in said
    assert "--resume with a larger --minutes trains it further" in refusal(
        capsys, lambda: run("budget-done", "--steps", "1000", "--minutes", "1e-6"))


def test_the_docstring_says_what_the_seed_study_holds():
    """Its three commands' claims against the committed runs: fix off and the paper's rule collapse on every seed
    run; no run whose delta read the fp32 O (`--fix on`, or an experiment's `--delta fp32-o`) collapsed."""
    root = Path(train.__file__).parent
    rows = [row for study in ("seed_study", "cure") for row in runs.read_table(root / "results" / study / "runs.csv")
            if not row.get("variant")]
    line = lambda fix: next(line for line in train.__doc__.splitlines() if f"python train.py --fix {fix} " in line)
    plain = [row for row in rows if row["fix"] in ("off", "paper") and row["attn"] == "kernel" and row["delta"] == "o"
             and row["stochastic_o"] == "off"]
    assert plain and all(row["collapsed"] for row in plain)
    assert "collapses (on every seed run" in line("off") and "collapses" in line("paper")
    fp32_o = [row for row in rows if row["fix"] == "on" or row["delta"] == "fp32-o"]
    assert len(fp32_o) >= 8 and not any(row["collapsed"] for row in fp32_o) and "trains through" in line("on")


def test_resume_may_change_the_length_and_intervals(run):
    run_dir = run(None, "--steps", "20")
    assert run_dir.name == "tiny-sdpa-fixoff-block32-batch8-data_words-s0"   # the default name
    run(None, "--steps", "30", "--minutes", "10", "--log-interval", "5", "--eval-interval", "10",
        "--compile", "off", "--resume")
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20, 25, 30]
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["steps"], config["minutes"], config["log_interval"]) == (30, 10.0, 5)
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 30


def test_resume_continues_a_run_in_the_older_spellings(run, capsys):
    """A run folder written before delta was spelled as today (delta_from_p and delta_fp32 where delta is now, as
    the committed runs have it) resumes under today's flags, refuses a flag that differs from what it ran, and goes
    on in today's spellings."""
    run_dir = run("old", "--attn", "emulate", "--delta", "fp32-o", "--steps", "20")
    config = json.loads((run_dir / "config.json").read_text())
    old = {k: v for k, v in config.items() if k != "delta"} | dict(delta_from_p=False, delta_fp32=True)
    (run_dir / "config.json").write_text(json.dumps(old))
    assert "--delta: the run has 'fp32-o', this command 'p'" in refusal(
        capsys, lambda: run("old", "--attn", "emulate", "--delta", "p", "--steps", "40", "--resume"))
    run("old", "--attn", "emulate", "--delta", "fp32-o", "--steps", "40", "--resume")
    assert json.loads((run_dir / "config.json").read_text()) == config | dict(steps=40)


def test_a_new_run_never_continues_another(run, capsys):
    """A new run whose folder holds a run with other settings: the error names them, and the --resume it
    mentions refuses them (it used to continue the run under the new settings)."""
    run_dir = run("x", "--steps", "20")
    assert re.search(r"exists, a run of preset tiny, attn sdpa, fix off, seed 0, .*differs in dtype 'fp32' "
                     r"\(the run: 'bf16'\)", refusal(capsys, lambda: run("x", "--steps", "20", "--dtype", "fp32")))
    assert "--dtype: the run has 'bf16', this command 'fp32'" in refusal(
        capsys, lambda: run("x", "--steps", "40", "--dtype", "fp32", "--resume"))
    assert json.loads((run_dir / "config.json").read_text())["dtype"] == "bf16"
    # without --name, the other settings get a folder of their own
    other = run(None, "--steps", "20", "--lr", "0.01")
    assert other.name == "tiny-sdpa-fixoff-lr0.01-block32-batch8-data_words-s0"
    assert "pass --resume to continue it" in refusal(capsys, lambda: run(None, "--steps", "30", "--lr", "0.01"))


def test_help_groups_the_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    groups, title = {}, None
    for line in capsys.readouterr().out.split("\noptions:\n")[1].splitlines():
        if re.fullmatch(r"\S.*:", line):
            title = line[:-1].split(" (")[0]
        elif flag := re.match(r"  (--[\w-]+)", line):
            groups.setdefault(title, set()).add(flag[1])
    assert groups["the demo"] == {"--fix", "--attn", "--seed", "--steps", "--minutes", "--data", "--preset", "--out",
                                  "--name", "--resume"}
    assert groups["experiments"] == {"--" + f.name.replace("_", "-") for f in fields(Numerics)} | {"--pos",
                                                                                                  "--qk-norm"}
    assert groups["model shape"] == {"--n-layer", "--n-head", "--n-embd", "--block-size"}
    assert groups["training"] == {"--lr", "--warmup", "--batch-size", "--dtype", "--compile", "--device",
                                  "--log-interval", "--eval-interval", "--diag-interval", "--ckpt-interval"}

    # every flag says what it does in words, and every flag that takes a value says its default
    for action in runconfig.parser(train.PRESETS, train.CHOICES)._actions:
        words = re.sub(r"\(default[^)]*\)", "", action.help)
        assert len(words.split()) >= 2, action.dest
        if action.option_strings and action.nargs != 0 and action.dest != "help":
            assert "default" in action.help, action.dest


@pytest.mark.parametrize("argv", [["--preset", "tiny", "--help"], ["--help", "--preset", "tiny"], ["--help"]])
def test_help_shows_the_chosen_presets_defaults(argv, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    text = " ".join(capsys.readouterr().out.split())
    tiny = "tiny" in argv
    assert f"The defaults shown are the {'tiny' if tiny else 'default'} preset's" in text
    assert f"--steps N training steps, one batch each (default {'300' if tiny else '200,000'})" in text
    assert f"--n-layer N transformer blocks (default {2 if tiny else 6})" in text
    assert f"learning rate (AdamW), constant after the warmup (default {0.003 if tiny else 0.001})" in text


def poison_step(monkeypatch, at):
    """Make the training loss of step `at` (counted as the log and the checkpoints count: the at-th step) NaN, and so
    the gradients and weights after it, as a bf16 blow-up does: the batch train.py's loop draws for that step
    (get_batch with the run's seed, 0, and at - 1, get_batch counting from 0; the tiny preset's evaluation draws seed
    0's steps 0-3, the diagnostics step 0 and seed 10**6) goes through a GPT.forward whose loss is multiplied by NaN."""
    poisoned, original = [], data.get_batch
    def get_batch(tokens, batch_size, block_size, seed, step):
        x, y = original(tokens, batch_size, block_size, seed, step)
        if (seed, step) == (0, at - 1):
            poisoned.append(x)
        return x, y
    forward = model.GPT.forward
    def poisoned_forward(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        return logits, loss * math.nan if any(idx is x for x in poisoned) else loss
    monkeypatch.setattr(data, "get_batch", get_batch)   # (train.py calls data.get_batch)
    monkeypatch.setattr(model.GPT, "forward", poisoned_forward)


def test_nan_stops_cleanly_and_keeps_last_good_checkpoint(run, monkeypatch, capsys):
    poison_step(monkeypatch, 25)
    run_dir = run("nan", "--steps", "60", "--ckpt-interval", "10")
    out = capsys.readouterr().out
    assert "collapse at step 25: non-finite loss at step 25" in out   # when it happens, above the progress bar
    assert re.search(r"^collapsed at step 25, after \d+\.\d training minutes: non-finite loss at step 25$", out, re.M)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["collapsed"] is True and summary["collapse_step"] == 25 and "step 25" in summary["reason"]
    assert summary["steps"] == 30 and summary["final_train_loss"] is None
    ckpts = [p.name for p in runs.checkpoints(run_dir)]
    assert ckpts == ["step_0000010.pt", "step_0000020.pt"]  # none from the poisoned weights
    last = torch.load(run_dir / "ckpt" / ckpts[-1])
    assert all(torch.isfinite(t).all() for t in last["model"].values())


def inf_gradient(monkeypatch, at):
    """Make every gradient of step `at` (counted from 0) infinite, its loss finite, as the backward can overflow
    before the forward does: the clipping (train.py's next call) then makes the weights NaN."""
    clip, step = torch.nn.utils.clip_grad_norm_, iter(range(10**6))
    def clip_with_an_inf_gradient(parameters, max_norm):
        parameters = list(parameters)
        if next(step) == at:
            for p in parameters:
                p.grad.fill_(math.inf)
        return clip(parameters, max_norm)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_with_an_inf_gradient)


def test_a_non_finite_gradient_of_a_finite_loss_is_not_checkpointed(run, monkeypatch, capsys):
    """A non-finite gradient whose loss is finite (as the backward can overflow before the forward does) makes the
    weights NaN through the clipping; the row right after it neither evaluates, nor diagnoses (which would fail on
    them), nor writes its checkpoint, and the run stops at the next step's non-finite loss, with the last good
    checkpoint."""
    inf_gradient(monkeypatch, 19)   # the last step before the checkpoint of step 20
    run_dir = run("inf-grad", "--steps", "60", "--ckpt-interval", "10")
    assert ("step 20: a non-finite gradient norm, its loss finite: the weights are not finite; no evaluation, "
            "diagnostics or checkpoint") in capsys.readouterr().out
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step_0000010.pt"]
    row = read_log(run_dir)[1]
    assert row["step"] == "20" and row["grad_norm"] == "inf" and row["val_loss"] == row["max_logit_L0"] == ""
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["collapse_step"] == 21 and summary["reason"] == "non-finite loss at step 21"   # the next step


def test_a_non_finite_gradient_in_the_last_row_is_a_collapse(run, monkeypatch):
    """On the run's last row no next step's loss will be non-finite: the non-finite gradient itself is the collapse
    (the weights it leaves are NaN), and no final checkpoint is written from them."""
    inf_gradient(monkeypatch, 19)   # the run's last step
    run_dir = run("inf-grad-last", "--steps", "20", "--ckpt-interval", "10")
    assert [p.name for p in runs.checkpoints(run_dir)] == ["step_0000010.pt"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["collapsed"] is True and summary["collapse_step"] == 20
    assert summary["reason"] == "non-finite gradient norm by step 20, its loss finite"


def test_a_gradient_norm_that_overflows_over_finite_gradients_poisons_nothing(run, monkeypatch):
    """Finite gradients whose norm overflows float32 are clipped to 0: the weights stay finite, so the row evaluates,
    diagnoses and checkpoints as any other, and the run goes on (its log says the norm was inf)."""
    clip, step = torch.nn.utils.clip_grad_norm_, iter(range(10**6))
    def clip_with_an_overflowing_norm(parameters, max_norm):
        parameters = list(parameters)
        norm = clip(parameters, max_norm)
        if next(step) == 9:   # the last step before the row and checkpoint of step 10
            for p in parameters:
                p.grad.zero_()   # (what clipping by max_norm / inf does to finite gradients)
            return torch.full_like(norm, math.inf)
        return norm
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip_with_an_overflowing_norm)
    run_dir = run("inf-norm", "--steps", "20", "--ckpt-interval", "10", "--diag-interval", "10")
    assert [p.name for p in runs.checkpoints(run_dir)][-2:] == ["step_0000010.pt", "step_0000020.pt"]
    row = read_log(run_dir)[0]
    assert row["step"] == "10" and row["grad_norm"] == "inf" and row["max_logit_L0"] != ""
    assert json.loads((run_dir / "summary.json").read_text())["collapsed"] is False


def test_loss_spike_criterion():
    state = {"ema": torch.tensor(2.0), "loss_min": float("inf")}
    c = dict(warmup=100, log_interval=10, eval_interval=20, diag_interval=20, ckpt_interval=20)
    assert train.loss_spike(state, 50, c) is None and state["loss_min"] == float("inf")  # warmup: not tracked
    assert train.loss_spike(state, 150, c) is None and state["loss_min"] == 2.0
    state["ema"] = torch.tensor(2.9)
    assert train.loss_spike(state, 160, c) is None  # within SPIKE_NATS of the minimum
    state["ema"] = torch.tensor(3.1)
    assert "1.10 nats above its minimum 2.00" in train.loss_spike(state, 170, c)
    # a run's last row off its intervals (--steps 157) is tested, not counted in the minimum: resumed from it, a run
    # tests its later rows against the uninterrupted run's minimum
    state = {"ema": torch.tensor(1.5), "loss_min": 2.0}
    assert train.loss_spike(state, 157, c) is None and state["loss_min"] == 2.0
    assert train.loss_spike(state, 160, c) is None and state["loss_min"] == 1.5


def test_minutes_budget_stops_the_run(run):
    summary = json.loads((run("budget", "--steps", "1000", "--minutes", "1e-6") / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["final_val_loss"] is not None  # the last row is evaluated


def test_runs_record_their_provenance(run, monkeypatch):
    """config.json and summary.json name the code (git commit, uncommitted changes) and the versions and device a
    run ran on, so that runs from before and after a change of the kernel can be told apart."""
    run_dir = run("provenance", "--steps", "10")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(train.__file__).parent, capture_output=True,
                          text=True)
    commit = head.stdout.strip() if head.returncode == 0 else os.environ.get("NANOLP_COMMIT")
    for file in ("config.json", "summary.json"):
        recorded = json.loads((run_dir / file).read_text())["provenance"]
        assert recorded == dict(commit=commit, dirty=recorded["dirty"], python=platform.python_version(),
                                torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
                                gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        assert recorded["dirty"] in ((True, False) if head.returncode == 0 else (None,))

    def no_git(*args, **kwargs):
        raise FileNotFoundError("git")
    monkeypatch.setattr(runs.subprocess, "run", no_git)   # a tree copied without git, as to a GPU machine
    monkeypatch.setenv("NANOLP_COMMIT", "0123abc")
    assert (runs.provenance("cpu")["commit"], runs.provenance("cpu")["dirty"]) == ("0123abc", None)
    assert runs.provenance("cpu")["gpu"] is None   # a CPU run, even on a machine with a GPU


# a bad setting of each kind (the run fixture's other flags are good), and the one line that says so
BAD_SETTINGS = [
    (("--steps", "0"), "--steps must be at least 1, got 0"),
    (("--steps", "-5"), "--steps must be at least 1, got -5"),
    (("--batch-size", "0"), "--batch-size must be at least 1, got 0"),
    (("--n-layer", "0"), "--n-layer must be at least 1, got 0"),
    (("--n-head", "3"), "--n-embd 64 is not divisible by --n-head 3: each head takes n_embd / n_head channels"),
    (("--n-head", "0"), "--n-head must be at least 1, got 0"),
    (("--block-size", "0"), "--block-size must be at least 1, got 0"),
    (("--warmup", "-1"), "--warmup must be at least 0, got -1"),
    (("--lr", "0"), "--lr must be a positive, finite number, got 0.0"),
    (("--lr", "inf"), "--lr must be a positive, finite number, got inf"),   # (it would save inf weights)
    (("--lr", "1e39"), "--lr 1e+39 overflows float32 in AdamW's first step, which divides it by 1 - beta1: it must "
                       "be at most 3.4e+37"),
    (("--lr", "3e38"), "--lr 3e+38 overflows float32 in AdamW's first step"),   # (a float32, but not lr / 0.1)
    (("--minutes", "-1"), "--minutes must be a positive, finite number, got -1.0"),
    (("--seed", "-1"), "--seed must be 0 to 999,999, got -1"),
    (("--seed", "1000000"), "--seed must be 0 to 999,999, got 1000000"),   # (the diagnostics' probe batches' seed)
    (("--minutes", "inf"), "--minutes must be a positive, finite number, got inf"),   # (JSON has no inf)
    (("--out", ""), "--out is empty: give the folder that run folders go in"),   # (not the current directory)
    (("--data", ""), "--data is empty: give a text file's path, or neither for TinyShakespeare"),
    *[((f"--{kind}-interval", "0"), f"--{kind}-interval must be at least 1, got 0")
      for kind in ("log", "eval", "diag", "ckpt")],
    (("--attn", "emulate", "--mantissa-bits", "7"), "argument --mantissa-bits: invalid choice: 7 (choose from 0, 1"),
    (("--attn", "emulate", "--amplify", "vo"), "--amplify vo says what --mantissa-bits rounds: give --mantissa-bits"),
    (("--fix", "on", "--mantissa-bits", "3"), "--fix on, --mantissa-bits 3: only our kernel has these (--attn kernel "
                                              "or emulate), not --attn sdpa"),
    (("--attn", "emulate", "--n-head", "4", "--n-embd", "32"), "--attn emulate needs a head size (--n-embd / "
                                                               "--n-head) of 16, 32, 64 or 128, got 32 / 4 = 8"),
    (("--attn", "emulate", "--fix", "on", "--delta", "p"), "--fix on (delta from the fp32 O) and --delta p are "
                                                           "different ways of computing delta: choose one"),
    (("--attn", "emulate", "--stochastic-o", "forward", "--delta", "stochastic-o"),
     "--stochastic-o forward and --delta stochastic-o are different stochastic roundings of the O that delta reads: "
     "choose one"),
    (("--attn", "emulate", "--exponent", "torch", "--precision", "autocast"),
     '--exponent torch is a form of the "fa2" exponent; --precision autocast rounds S on its own'),
    (("--precision", "paper"), "argument --precision: invalid choice: 'paper'"),
    (("--att", "fp32"), "unrecognized arguments: --att fp32"),   # (a prefix would run, and no study could compare it)
    (("--attn", "emulate", "--dtype", "fp32"), "--dtype fp32 needs --attn sdpa or fp32"),
    (("--attn", "sdpa-cudnn"), "--attn sdpa-cudnn needs a CUDA device, not cpu"),
    (("--device", "gpu"), "--device 'gpu' is not a device torch knows"),
    (("--device", "meta"), "--device meta: train.py runs on a CPU or a CUDA device (cpu, cuda, cuda:1, ...), not "
                           "meta"),
    (("--device", "cuda"), "--device cuda: this machine has 0 CUDA devices"),
    *[(("--name", name), f"--name must be a plain folder name (no / or \\, not . or ..), got {name!r}")
      for name in ("../../escape", "a/b", "..", ".", "")],
]


@pytest.mark.parametrize("flags, message", BAD_SETTINGS, ids=[" ".join(flags) for flags, _ in BAD_SETTINGS])
def test_a_bad_setting_is_refused_before_a_folder_is_made(flags, message, run, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)   # a machine without CUDA, wherever this runs
    monkeypatch.chdir(tmp_path)   # (where an empty --out would put the run)
    err = refusal(capsys, lambda: run("bad", *flags))
    assert err.startswith(f"train.py: error: {message}") and err.count("\n") == 1
    assert not (tmp_path / "runs").exists() and not (tmp_path.parent / "escape").exists()
    assert not (tmp_path / "bad").exists()


def test_every_bad_setting_gets_its_line(run, tmp_path, capsys):
    err = refusal(capsys, lambda: run("bad", "--steps", "-5", "--batch-size", "0", "--n-head", "3"))
    assert [line.split(": ")[2] for line in err.splitlines()] == [
        "--steps must be at least 1, got -5", "--batch-size must be at least 1, got 0",
        "--n-embd 64 is not divisible by --n-head 3"]
    assert not (tmp_path / "runs").exists()


def test_a_text_that_cannot_be_trained_on_is_refused_in_one_line(run, tmp_path, monkeypatch, capsys):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1") * 1000)
    short = tmp_path / "short.txt"
    short.write_text("0123456789")
    for text, message in ((latin, f"{latin} is not UTF-8 (byte 3, 0xe9: invalid continuation byte)"),
                          (short, f"{short} is too short: 10 characters, so its training split has 9, and one "
                                  f"example takes block_size + 1 = 33"),
                          (tmp_path / "missing.txt", f"no text file at {tmp_path / 'missing.txt'}")):
        err = refusal(capsys, lambda: run("text", "--data", str(text)))
        assert err.startswith(f"train.py: error: {message}") and err.count("\n") == 1
    # no text given, none at the default place, and no network: where to put one
    monkeypatch.setattr(data, "DEFAULT_TEXT", tmp_path / "tinyshakespeare" / "input.txt")
    monkeypatch.setattr(data, "DEFAULT_URL", "http://127.0.0.1:9/input.txt")
    err = refusal(capsys, lambda: train.main(["--preset", "tiny", "--attn", "sdpa", "--device", "cpu", "--out",
                                              str(tmp_path / "runs")]))
    assert re.fullmatch(r"train.py: error: no text at \S+/tinyshakespeare/input.txt and the download from \S+ "
                        r"failed .*Copy TinyShakespeare's input.txt to \S+/tinyshakespeare/input.txt .*--data PATH.*\n",
                        err)
    assert not (tmp_path / "runs").exists()


def test_ctrl_c_outside_the_loop_ends_in_one_line(run, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the text is prepared or the model is built: one line and status 130, no traceback; the same
    command then trains. After the loop, as the summary is written: the line that continues the run."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    for module, step in ((data, "prepare"), (train, "GPT")):
        with monkeypatch.context() as patched:
            patched.setattr(module, step, interrupted)
            capsys.readouterr()
            with pytest.raises(SystemExit) as exited:
                run("early", "--steps", "20")
        assert exited.value.code == 130 and capsys.readouterr().err == (
            "train.py: stopped before the first training step: nothing was trained; the same command runs it "
            "again\n"), step
    assert runs.read_json(run("early", "--steps", "20") / "summary.json")["steps"] == 20
    # after the loop, as its summary is written: the run's last checkpoint and the command that writes the summary
    with monkeypatch.context() as patched:
        patched.setattr(runs, "write_summary", interrupted)
        with pytest.raises(SystemExit) as exited:
            run("late", "--steps", "40")
    assert exited.value.code == 130 and capsys.readouterr().err.splitlines()[-1].startswith(
        f"train.py: stopped at step 40; last checkpoint {tmp_path / 'runs' / 'late' / 'ckpt' / 'step_0000040.pt'}")
    assert runs.read_json(run("late", "--steps", "40", "--resume") / "summary.json")["steps"] == 40


def test_ctrl_c_once_the_run_has_ended_keeps_its_result(run, tmp_path, monkeypatch, capsys):
    """Ctrl-C after the loop found a collapse (in the rows after it, or as the summary is written): the collapse is
    the run's result, its summary written before the line that says the run ended; no --resume is offered (it would
    cut the log back to a checkpoint before the collapse). Ctrl-C as the outcome is printed: the run ended too."""
    poison_step(monkeypatch, 25)
    original, calls = runs.write_summary, []
    def interrupted_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return original(*args)
    with monkeypatch.context() as patched:
        patched.setattr(runs, "write_summary", interrupted_once)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            run("nan", "--steps", "60", "--ckpt-interval", "10")
    run_dir = tmp_path / "runs" / "nan"
    summary = runs.read_json(run_dir / "summary.json")
    assert summary["collapsed"] and summary["collapse_step"] == 25 and len(calls) == 2
    assert re.fullmatch(rf"train.py: stopped at step 30, the run ended: collapsed at step 25, after \d+\.\d training "
                        rf"minutes: non-finite loss at step 25; {re.escape(str(run_dir / 'summary.json'))} holds it",
                        capsys.readouterr().err.splitlines()[-1]) and exited.value.code == 130
    assert "kept as it ended" in refusal(capsys, lambda: run("nan", "--steps", "60", "--resume"))

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "print_outcome", interrupted)
    with pytest.raises(SystemExit) as exited:
        run("done", "--steps", "20")
    assert re.fullmatch(rf"train.py: stopped at step 20, the run ended: no collapse in 20 steps \(\d+\.\d training "
                        rf"minutes\); {re.escape(str(tmp_path / 'runs' / 'done' / 'summary.json'))} holds it",
                        capsys.readouterr().err.splitlines()[-1]) and exited.value.code == 130


def test_an_attempt_that_stopped_before_its_first_checkpoint_is_replaced(run, tmp_path, monkeypatch, capsys):
    def interrupted(*args):
        raise KeyboardInterrupt
    with monkeypatch.context() as patched:
        patched.setattr(runs, "save_checkpoint", interrupted)   # Ctrl-C as the first checkpoint was due
        capsys.readouterr()
        with pytest.raises(SystemExit) as exited:
            run("early", "--steps", "40")
    assert exited.value.code == 130 and capsys.readouterr().err.splitlines()[-1] == (
        "train.py: stopped at step 20, before the run's first checkpoint (every 20 steps): nothing to resume; the "
        "same command starts the run again")
    run_dir = tmp_path / "runs" / "early"
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", "log.csv"]   # and no lock left behind
    assert "--resume: no checkpoint in" in refusal(capsys, lambda: run("early", "--steps", "40", "--resume"))
    capsys.readouterr()
    run("early", "--steps", "40")   # the same command again
    assert f"{run_dir}: replacing an attempt that stopped before its first checkpoint" in capsys.readouterr().out
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20, 30, 40]
    # no command touches a folder that a live run is writing; a lock whose process is gone is stale, and ignored
    (run_dir / runs.LOCK).write_text(str(os.getpid()))
    for flags in ((), ("--resume",)):
        assert f"{run_dir} is being written by a live run (process {os.getpid()})" in refusal(
            capsys, lambda: run("early", "--steps", "60", *flags))
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20, 30, 40]
    killed = subprocess.Popen(["true"])
    killed.wait()
    (run_dir / runs.LOCK).write_text(str(killed.pid))
    run("early", "--steps", "50", "--resume")
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20, 30, 40, 50]
    assert not (run_dir / runs.LOCK).exists()
    # a lock this user cannot read, and a filesystem without hard links: one line each, the folder untouched
    (run_dir / runs.LOCK).write_text("1")
    with monkeypatch.context() as patched:
        unread = Path.read_text
        patched.setattr(Path, "read_text", lambda self, *a, **k: (_ for _ in ()).throw(PermissionError(
            13, "Permission denied")) if self.name == runs.LOCK else unread(self, *a, **k))
        assert refusal(capsys, lambda: run("early", "--steps", "60", "--resume")) == (
            f"train.py: error: cannot read the lock {run_dir / runs.LOCK} (Permission denied): if no run is "
            f"writing {run_dir}, delete it\n")
    (run_dir / runs.LOCK).unlink()
    with monkeypatch.context() as patched:
        patched.setattr(os, "link", lambda *a: (_ for _ in ()).throw(PermissionError(1, "Operation not permitted")))
        assert refusal(capsys, lambda: run("early", "--steps", "60", "--resume")) == (
            f"train.py: error: cannot lock the run folder {run_dir} (Operation not permitted): runs are written "
            f"where the filesystem allows hard links; give another --out\n")
    assert [int(r["step"]) for r in read_log(run_dir)] == [10, 20, 30, 40, 50]
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt", "config.json", "log.csv", "summary.json"]


def test_a_collapse_is_recorded_with_its_row(run, monkeypatch, capsys, tmp_path):
    """A run killed in the rows after its loss spike (no Ctrl-C: nothing of train.py runs) has its summary.json
    already: --resume, which would cut the log back to the last checkpoint and might train through, refuses."""
    monkeypatch.setattr(train, "SPIKE_NATS", -1.0)   # every row after the warmup reads as a spike
    run_dir, append = tmp_path / "runs" / "killed", runs.write_rows
    def killed_after_the_collapse(path, rows, columns, mode="a"):
        if rows and (run_dir / "summary.json").exists():
            raise RuntimeError("killed")
        append(path, rows, columns, mode)
    with monkeypatch.context() as patched:
        patched.setattr(runs, "write_rows", killed_after_the_collapse)
        with pytest.raises(RuntimeError, match="killed"):
            run("killed", "--steps", "300")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["collapsed"] and read_log(run_dir)[-1]["step"] == str(summary["collapse_step"]) == "30"
    assert "kept as it ended: it collapsed at step 30 (loss spike" in refusal(
        capsys, lambda: run("killed", "--steps", "300", "--resume"))


def test_ctrl_c_in_a_collapse_rows_diagnostics_keeps_the_row(run, monkeypatch, tmp_path):
    """Ctrl-C while the row that found the collapse evaluates: the row is written (without what it had not
    computed) before the summary, which so never names a step past the log's end."""
    monkeypatch.setattr(train, "SPIKE_NATS", -1.0)
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "evaluate", interrupted)
    with pytest.raises(SystemExit):
        run("interrupted", "--steps", "300", "--eval-interval", "30")   # (the first spike: at row 30)
    run_dir = tmp_path / "runs" / "interrupted"
    summary = json.loads((run_dir / "summary.json").read_text())
    last = read_log(run_dir)[-1]
    assert summary["collapsed"] and last["step"] == str(summary["collapse_step"]) == str(summary["steps"]) == "30"
    assert last["val_loss"] == "" and last["train_loss"] != ""


def test_a_collapsed_run_stays_collapsed(run, monkeypatch, capsys, tmp_path):
    """--resume would continue from the last good checkpoint and write over the collapse, the result: it refuses. A
    run that collapsed before its first checkpoint has a summary.json, a result too: never replaced."""
    for name, at in (("collapsed", 25), ("collapsed-early", 5)):
        with monkeypatch.context() as poisoned:
            poison_step(poisoned, at)
            run(name, "--steps", "60")
    run_dir, early = (tmp_path / "runs" / name for name in ("collapsed", "collapsed-early"))
    kept = {d: ((d / "summary.json").read_text(), read_log(d)) for d in (run_dir, early)}
    assert (run_dir / "ckpt" / "step_0000020.pt").exists() and not (early / "ckpt").exists()
    assert refusal(capsys, lambda: run("collapsed", "--steps", "60", "--resume")) == (
        f"train.py: error: --resume: {run_dir} is kept as it ended: it collapsed at step 25 (non-finite loss at "
        f"step 25); start a new run with another --name\n")
    for name, step in (("collapsed", 25), ("collapsed-early", 5)):
        assert f"it collapsed at step {step} (non-finite loss at step {step}): give a new run another --name" in (
            refusal(capsys, lambda: run(name, "--steps", "60")))
    assert "collapsed at step 5" in refusal(capsys, lambda: run("collapsed-early", "--steps", "60", "--resume"))
    assert {d: ((d / "summary.json").read_text(), read_log(d)) for d in (run_dir, early)} == kept


def test_attn_kernel_on_a_cpu_says_it_runs_the_emulation(run, capsys):
    run_dir = run("kernel", "--attn", "kernel", "--steps", "10")
    assert "attn kernel (on cpu: its PyTorch emulation, nanolp/emulate.py)" in capsys.readouterr().out
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["attn"], config["attn_impl"]) == ("kernel", "emulate")
    assert model.implementation("kernel", "cuda") == "kernel" and model.implementation("sdpa", "cpu") == "sdpa"


def test_a_gpu_preset_without_cuda_is_refused_unless_device_cpu_insists(text, tmp_path, monkeypatch, capsys):
    """Without CUDA, a preset sized for a GPU stops before it builds anything (no text read, no folder, no model),
    in one line: what a step and the run would take on a CPU, and the tiny preset's command; --device cpu insists,
    and --resume continues a run on the device it ran on."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    common = ["--data", str(text), "--out", str(tmp_path / "runs")]
    with monkeypatch.context() as patched:
        def built(*args, **kwargs):
            raise AssertionError("built before the refusal")
        for module, step in ((data, "find_text"), (data, "prepare"), (train, "GPT"), (runs, "locked")):
            patched.setattr(module, step, built)
        assert refusal(capsys, lambda: train.main(common)) == (
            "train.py: error: the default preset is sized for a GPU and this machine has no CUDA device: a step takes "
            "about 42-50 s on two CPU cores, its 200,000 steps 97-116 days (--device cpu trains it here anyway); a "
            f"smoke run of seconds: python train.py --preset tiny --data {text}\n")
        assert refusal(capsys, lambda: train.main(["--preset", "gpt2", "--fix", "on", *common])).endswith(
            "a step takes about 25-29 minutes on two CPU cores, its 10,000 steps 171-204 days (--device cpu trains "
            f"it here anyway); a smoke run of seconds: python train.py --preset tiny --fix on --data {text}\n")
        # the smoke run keeps the command's arm, less the GPU preset's size
        arm = ["--attn", "fp32", "--pos", "rope", "--seed", "3"]
        assert refusal(capsys, lambda: train.main([*arm, *common])).endswith(
            f"python train.py --preset tiny --attn fp32 --pos rope --data {text} --seed 3\n")
    assert not (tmp_path / "runs").exists()
    # the default preset, made small enough to train here in a moment
    small = [*common, "--name", "small", "--attn", "sdpa", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
             "--block-size", "16", "--batch-size", "4", "--log-interval", "1"]
    assert "python train.py --preset tiny" in refusal(capsys, lambda: train.main([*small, "--steps", "2"]))
    assert train.main([*small, "--steps", "2", "--device", "cpu"])["steps"] == 2
    assert train.main([*small, "--steps", "3", "--resume"])["steps"] == 3   # it ran on the CPU: it goes on there


def test_a_gpu_without_bf16_is_refused_in_one_line(text, tmp_path, monkeypatch, capsys):
    """A T4 (compute capability 7.5) has no bf16: one line that names the GPU and what it takes, before anything is
    built; --dtype fp32 with fp32 attention needs no bf16 and is not refused for it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    def built(*args, **kwargs):
        raise AssertionError("built before the refusal")
    monkeypatch.setattr(data, "find_text", built)
    common = ["--data", str(text), "--out", str(tmp_path / "runs")]
    assert refusal(capsys, lambda: train.main(common)) == (
        "train.py: error: this GPU (Tesla T4, compute capability 7.5) has no bf16, the precision whose failure this "
        "project trains: it takes compute capability 8.0 or later (an A100, RTX 30xx or 40xx, L4, H100); on this "
        "machine's CPU: python train.py --preset tiny --device cpu\n")
    with pytest.raises(AssertionError, match="built before the refusal"):   # past the check: it would train
        train.main([*common, "--dtype", "fp32", "--attn", "fp32"])
    assert not (tmp_path / "runs").exists()


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
