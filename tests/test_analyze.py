"""analyze.py on small synthetic run folders, and the --mechanism demonstration on tiny inputs."""

import csv
import json

import numpy as np
import pytest

import analyze
from nanolp import mechanism, plots
from nanolp.diagnostics import diag_columns
from nanolp.plots import PALETTE, label, run_styles
from nanolp.runs import Run, load_run

N_LAYER, N_HEAD = 2, 2
STEPS = np.arange(0, 400, 10)
COLLAPSE_STEP = 300


def columns():
    return (["step", "elapsed_s", "tokens", "lr", "train_loss", "val_loss", "grad_norm", "tokens_per_s", "mfu"]
            + diag_columns(N_LAYER, N_HEAD))


def synthetic_log(collapse, rng):
    """One row per step. The collapsing run's tie rate rises from step 200, its layer 1 W_Q grows,
    its loss explodes at the collapse; diagnostics are logged every other row, val every 5th."""
    rows = []
    for step in STEPS:
        late = collapse and step >= 200
        row = dict(step=step, elapsed_s=step * 1.5, tokens=step * 1024, lr=1e-3,
                   train_loss=(12.0 if collapse and step >= COLLAPSE_STEP else 4.0 - step / 200),
                   val_loss=(4.1 - step / 200 if step % 50 == 0 else ""),
                   grad_norm=1.0, tokens_per_s=5000.0, mfu=0.1)
        diag = step % 20 == 0
        for i in range(N_LAYER):
            grow = 1 + (step / 100 if collapse and i == 1 else step / 1000)
            row |= {f"max_logit_L{i}": 10 * grow, f"tie_rate_L{i}": (0.1 if late else 0.01) + 0.001 * rng.random(),
                    f"sn_q_L{i}": grow, f"sn_k_L{i}": grow, f"delta_err_L{i}": -1e-3 if collapse else 1e-4,
                    f"delta_push_L{i}": 1e-3 if collapse else 0.0, f"sharp_rate_L{i}": 0.3 if late else 0.02}
            row |= {f"sn_q_L{i}_H{h}": grow * (h + 1) for h in range(N_HEAD)}
            row |= {f"delta_err_L{i}_H{h}": -1e-3 for h in range(N_HEAD)}
            row |= {f"tie_rate_L{i}_H{h}": row[f"tie_rate_L{i}"] * (2 if (i, h) == (1, 1) else 1) for h in range(N_HEAD)}
            if not diag:  # diagnostics not computed on this row: empty cells
                row |= {c: "" for c in row if "_L" in c}
        rows.append(row)
    return rows


def write_run(root, name, fix, attn, seed, collapse, rng, **extra):
    run = root / name
    run.mkdir(parents=True)
    config = dict(preset="test", fix=fix, attn=attn, precision="paper", seed=seed, n_layer=N_LAYER, n_head=N_HEAD,
                  **extra)  # without extra: an older run, no delta_from_p / mantissa_bits keys
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
                   final_train_loss=rows[-1]["train_loss"], max_logit=None, tokens_per_s=5000.0, mfu=0.1,
                   peak_mem_gb=None)
    (run / "summary.json").write_text(json.dumps(summary))
    return rows


def expected_lead(rows, k=2.0):
    """The early-warning lead recomputed by hand: baseline = median of the max-over-layers tie rate on
    the logged steps up to half the collapse step; warning = first later step above k * baseline."""
    logged = [(r["step"], max(r[f"tie_rate_L{i}"] for i in range(N_LAYER))) for r in rows
              if r["tie_rate_L0"] != ""]
    baseline = np.median([t for s, t in logged if s <= COLLAPSE_STEP / 2])
    warn = next(s for s, t in logged if s > COLLAPSE_STEP / 2 and t > k * baseline)
    return COLLAPSE_STEP - warn


def test_runs_report_and_figures(tmp_path):
    rng = np.random.default_rng(0)
    runs = tmp_path / "runs"
    collapsed = write_run(runs, "kernel-off-s0", "off", "kernel", 0, True, rng)
    write_run(runs, "kernel-on-s0", "on", "kernel", 0, False, rng)
    write_run(runs, "sdpa-s1", "off", "sdpa", 1, False, rng)
    write_run(runs, "kernel-off-p3", "off", "kernel", 0, False, rng, delta_from_p=False, mantissa_bits=3)
    write_run(runs, "kernel-off-p3-dp", "off", "kernel", 0, False, rng, delta_from_p=True, mantissa_bits=3)
    write_run(runs, "kernel-off-dfp32", "off", "kernel", 0, False, rng, delta_fp32=True)
    # a run still in progress: no summary.json, no val loss, no diagnostics at all
    partial = runs / "partial"
    partial.mkdir()
    with open(partial / "log.csv", "w", newline="") as f:
        f.write("step,elapsed_s,tokens,lr,train_loss,val_loss\n0,0,0,0.001,4.2,\n10,5,1024,0.001,4.0,\n")

    analyze.main([str(runs)])

    out = runs / "figures"
    for name in ("loss", "max_logit", "spectral_norm", "spectral_norm_heads", "tie_rate", "delta_err"):
        assert (out / f"{name}.png").stat().st_size > 0, name
    report = (out / "report.md").read_text()
    row = next(line for line in report.splitlines() if line.startswith("| `kernel-off-s0`"))
    assert f"step {COLLAPSE_STEP}, {COLLAPSE_STEP * 1.5 / 60:.1f} min" in row
    final_val = [r["val_loss"] for r in collapsed if r["val_loss"] != ""][-1]
    assert f"{final_val:.4f}" in row
    assert "| `partial` | n/a | n/a | n/a | n/a | n/a | n/a | n/a (no summary.json) | n/a | n/a |" in report
    assert "| `kernel-off-p3-dp` | off | kernel | paper | P3b | P | 0 | no |" in report
    assert "| `kernel-off-s0` | off | kernel | paper | - | O | 0 |" in report
    assert "| `kernel-off-dfp32` | off | kernel | paper | - | fp32 O | 0 |" in report
    assert "**layer 1**" in report  # the synthetic collapsing run grows W_Q in layer 1
    assert "- `kernel-off-s0`: layer 1, head 1: 0.2" in report  # and ties most in its head 1
    lead = expected_lead(collapsed)
    assert lead > 0
    assert f"{lead} steps before the collapse at step {COLLAPSE_STEP}" in report


def test_arm_rates(tmp_path):
    """The per-arm table of a seed study, in report.md and rates.csv: two arms, one collapsed run. The summaries'
    values are chosen so that each median differs from the mean; off's max logits come from its logs."""
    rng = np.random.default_rng(0)
    runs = tmp_path / "runs"
    seeds = [("off", 0, True, dict(steps=300, tokens_per_s=4000.0, final_val_loss=9.0)),
             ("off", 1, False, dict(steps=390, tokens_per_s=5000.0, final_val_loss=2.0)),
             ("off", 2, False, dict(steps=100, tokens_per_s=9000.0, final_val_loss=2.5)),
             ("on", 0, False, dict(steps=390, tokens_per_s=6000.0, final_val_loss=2.2, max_logit=20.0)),
             ("on", 1, False, dict(steps=200, tokens_per_s=7000.0, final_val_loss=2.4, max_logit=30.0))]
    max_logits = []
    for fix, seed, collapse, values in seeds:
        rows = write_run(runs, f"b16-{fix}-s{seed}", fix, "kernel", seed, collapse, rng)
        summary = runs / f"b16-{fix}-s{seed}" / "summary.json"
        summary.write_text(json.dumps(json.loads(summary.read_text()) | values))
        if fix == "off":
            max_logits.append(max(r[f"max_logit_L{i}"] for r in rows for i in range(N_LAYER)
                                  if r[f"max_logit_L{i}"] != ""))
    assert max_logits[0] > max_logits[1] == max_logits[2]  # the collapsing run's grow: median != mean

    analyze.main([str(runs)])

    report = (runs / "figures" / "report.md").read_text()
    minutes = COLLAPSE_STEP * 1.5 / 60
    assert f"| `b16-off` | 1/3 | {minutes:.1f} | 300 | 2.5000 | {max_logits[1]:.4g} | 5,000 | - |" in report
    assert "| `b16-on` | 0/2 | - | 295 | 2.3000 | 25 | 6,500 | - |" in report  # no fp32 arm to compare with
    with open(runs / "figures" / "rates.csv", newline="") as f:
        rates = list(csv.DictReader(f))
    assert [(r["arm"], r["collapsed"], r["runs"], r["median_collapse_minute"]) for r in rates] == [
        ("b16-off", "1", "3", str(minutes)), ("b16-on", "0", "2", "")]
    numbers = [float(r[f"median_{key}"]) for r in rates
               for key in ("steps", "final_val_loss", "max_logit", "tokens_per_s")]
    assert numbers == pytest.approx([300, 2.5, max_logits[1], 5000, 295, 2.3, 25, 6500], rel=1e-5)

    analyze.main([str(runs / "b16-on-s0"), str(runs / "b16-on-s1"), "--out", str(tmp_path / "on")])  # one arm
    with open(tmp_path / "on" / "rates.csv", newline="") as f:
        assert [r["arm"] for r in csv.DictReader(f)] == ["b16-on"]


def test_val_loss_against_fp32_at_the_same_step(tmp_path):
    """Issue 7's yardstick: an arm's median val loss over the fp32 arm's, at the last step every run logged."""
    def run(name, attn, last, loss_at_300):
        step = np.arange(100.0, last + 1, 100.0)
        val = np.where(step == 300, loss_at_300, 3.0)
        return Run(tmp_path / name, dict(attn=attn, fix="on", seed=0), {}, {"step": step, "val_loss": val})
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
    assert [(r["arm"], r["val_step"]) for r in rows] == [("on-a", 300), ("on-b", 400), ("fp32-a", 500)]
    assert rows[2]["val_loss_vs_fp32"] == pytest.approx(1.0)


def test_bits_law(tmp_path):
    """Take-off and collapse 3x later per bit at 2-4 bits: the fit finds 3 and extrapolates to 7 bits; a run that
    never took off and a fix-on run are left out; plain bf16 at the same lr is the measured row at 7 bits, not
    fitted, and plain bf16 at another lr is left out."""
    def run(name, bits, takeoff, collapse, fix="off", steps=None, lr=1e-3):
        step = np.arange(0, 2 * (collapse or takeoff or 1000) + 1, 50.0)
        logit = np.where(step >= takeoff, 500.0, 20.0) if takeoff else np.full_like(step, 20.0)
        summary = dict(collapsed=collapse is not None, collapse_step=collapse, steps=steps or int(step[-1]))
        config = dict(fix=fix, attn="kernel", mantissa_bits=bits, amplify="p", seed=0, lr=lr)
        # layer 1 sits above the take-off line from the start without growing: the take-off is read in layer 0
        return Run(tmp_path / name, config, summary, {"step": step, "max_logit_L1": 150.0 + 0 * step,
                                                      "max_logit_L0": logit})
    runs = [run("b2", 2, 1000, 2000), run("b3", 3, 3000, 6000), run("b4", 4, 9000, 18000),
            run("b5", 5, None, None, steps=25000), run("b3on", 3, 100, 200, fix="on"), run("bf16", 0, 50, 100),
            run("bf16lr3", 0, 70, 140, lr=3e-3)]
    assert analyze.takeoff_step(runs[1]) == 3000 and analyze.takeoff_step(runs[3]) is None
    rows, fits = analyze.bits_law(runs)
    assert [(r["bits"], r["takeoff"], r["collapse"], r["reached"], r["measured"]) for r in rows] == [
        (2, 1000, 2000, 4000, False), (3, 3000, 6000, 12000, False), (4, 9000, 18000, 36000, False),
        (5, None, None, 25000, False), (7, 50, 100, 200, True)]
    assert fits["takeoff"]["per_bit"] == pytest.approx(3.0) and fits["collapse"]["per_bit"] == pytest.approx(3.0)
    assert fits["takeoff"]["at_bf16"] == pytest.approx(1000 * 3.0 ** 5)
    assert fits["collapse"]["at_bf16"] == pytest.approx(2000 * 3.0 ** 5)
    assert "~486,000 steps, an extrapolation; measured: 100" in "\n".join(analyze.bits_law_lines(rows, fits))
    assert analyze.plot_bits_law(rows, fits, tmp_path / "law.png").stat().st_size > 0
    assert analyze.bits_law(runs[:1] + runs[3:]) is None  # one value of B with a take-off: nothing to fit


def test_labels_and_colours(tmp_path):
    """Runs that differ only in delta_from_p or mantissa_bits get different labels; the delta_from_p
    control is green like fp32 attention but in its own shade; missing keys read as 0 / False."""
    rng = np.random.default_rng(0)
    for name, extra in (("old", {}), ("p3", dict(mantissa_bits=3, delta_from_p=False)),
                        ("p3-dp", dict(mantissa_bits=3, delta_from_p=True)),
                        ("p3-on", dict(mantissa_bits=3, delta_from_p=False))):
        write_run(tmp_path, name, "on" if name.endswith("on") else "off", "kernel", 0, False, rng, **extra)
    write_run(tmp_path, "fp32", "off", "fp32", 0, False, rng)
    write_run(tmp_path, "dfp32", "off", "kernel", 0, False, rng, delta_fp32=True)
    write_run(tmp_path, "p3-again", "off", "kernel", 0, False, rng, mantissa_bits=3)  # same label as p3
    write_run(tmp_path, "p3-lr", "off", "kernel", 0, False, rng, mantissa_bits=3, lr=3e-3)  # others: no lr
    runs = {p.name: load_run(p) for p in sorted(tmp_path.iterdir())}
    styles = run_styles(list(runs.values()))
    style = {name: styles[run.path] for name, run in runs.items()}
    assert label(runs["old"]) == "kernel paper fix off seed 0"
    assert label(runs["p3"]) == "kernel paper fix off P3b seed 0"
    assert label(runs["p3-dp"]) == "kernel paper fix off P3b delta-from-p seed 0"
    assert label(runs["p3-on"]) == "kernel paper fix on P3b seed 0"
    assert label(runs["fp32"]) == "fp32 seed 0"
    assert label(runs["dfp32"]) == "kernel paper fix off delta-fp32 seed 0"
    assert style["dfp32"]["color"] in PALETTE["delta from fp32 O"]
    assert style["p3-lr"]["label"] == "kernel paper fix off P3b seed 0 lr 0.003"  # the unusual lr shown
    assert style["p3"]["label"] == "kernel paper fix off P3b seed 0 (p3)"  # a duplicate label: name added
    assert len({s["label"] for s in style.values()}) == len(style)
    assert style["p3-dp"]["color"] in PALETTE["delta from P"] and style["fp32"]["color"] in PALETTE["fp32"]
    assert style["p3-dp"]["color"] != style["fp32"]["color"]
    assert style["p3"]["color"] != style["old"]["color"]  # same family, different shade
    assert not set(PALETTE["delta from P"]) & set(PALETTE["fp32"])
    assert style["p3-again"]["color"] != style["p3"]["color"]  # a twin arm: its own shade


def test_twin_arms_over_four_seeds_all_look_different(tmp_path):
    """Three arms the config cannot tell apart (patched kernel copies, e.g. o32, next to the plain one), over
    seeds 0-3, as many seeds as line styles: one shade per arm, one line style per seed, the same in every arm;
    and the same run twice (two folders), another line style."""
    rng = np.random.default_rng(0)
    for name in ("off", "o32", "p16"):
        for seed in (0, 1, 2, 3):
            write_run(tmp_path, f"{name}-s{seed}", "off", "kernel", seed, False, rng)
    write_run(tmp_path / "again", "off-s0", "off", "kernel", 0, False, rng)
    runs = [load_run(p) for p in sorted(tmp_path.iterdir()) if p.name != "again"]
    runs.append(load_run(tmp_path / "again" / "off-s0"))
    styles = {r.path: run_styles(runs)[r.path] for r in runs}
    looks = {(s["color"], s["linestyle"]) for s in styles.values()}
    assert len(looks) == len(runs)
    by_name = {}
    for r in runs[:-1]:
        by_name.setdefault(r.name[:-3], set()).add(styles[r.path]["color"])
    assert all(len(colours) == 1 for colours in by_name.values()) and len(set.union(*by_name.values())) == 3


def test_grid_panels_keep_step_labels_apart(tmp_path, monkeypatch):
    """Runs 120,000 steps long in a narrow panel: at most 5 step labels, so six-digit numbers do not run together."""
    rng = np.random.default_rng(0)
    write_run(tmp_path, "long", "off", "kernel", 0, False, rng)
    run = load_run(tmp_path / "long")
    run.log["step"] = run.log["step"] * 300  # 0 .. 117,000
    figures = []
    monkeypatch.setattr(plots, "save", lambda fig, path: figures.append(fig))
    plots.plot_grid([run], run_styles([run]), [["sn_q_L0", "sn_q_L1"]], "t", "y", tmp_path / "g.png")
    for ax in figures[0].axes:
        lo, hi = ax.get_xlim()
        assert 2 <= sum(lo <= t <= hi for t in ax.get_xticks()) <= 5


def test_mechanism_worked_example():
    example = mechanism.worked_example()
    assert example["bf16"] == -4.71875  # bit-exact: the fp32 sum rounds away from zero
    assert example["error"] == pytest.approx(-0.01476, abs=1e-5)


def test_mechanism_tied_rows_bias(tmp_path):
    results = mechanism.tied_rows_experiment(mechanism.emulate_attention, "cpu", ties=(2,), rows=1024)
    (off, se_off), (on, _) = (mechanism.stats(results["paper", fix, 2][0]) for fix in (False, True))
    # nanolp.tied's rows, as in tests/test_mechanism.py: with the fix off the two tied P entries are exactly 1,
    # so the bf16 sums of P V sit on rounding midpoints and the tiny, mostly negative terms from the other keys
    # (V ~ N(-1, 0.5)) tip them away from zero: O is pushed negative, by many standard errors, and the fix
    # removes most of it (measured with seed 0: -1.04e-3, s.e. 6.7e-6, off; -7.1e-5 on).
    assert off < -5 * se_off
    assert abs(on) * 3 < abs(off)
    mechanism.plot_error_histograms(results, 2, tmp_path / "hist.png")
    mechanism.plot_error_vs_k(results, [2], tmp_path / "vs_k.png")
    assert (tmp_path / "hist.png").stat().st_size > 0 and (tmp_path / "vs_k.png").stat().st_size > 0


def test_mechanism_checkpoint_per_head(tmp_path, monkeypatch):
    """Part 3 on a tiny untrained GPT: the checkpoint before the collapse is picked, and the
    per-layer, per-head delta errors are computed and drawn."""
    import torch

    import nanolp.data
    from model import GPT, GPTConfig
    from nanolp.runs import Run, load_run

    monkeypatch.setattr(nanolp.data, "DATA_DIR", tmp_path / "data")  # token cache out of the repo
    text = tmp_path / "text.txt"
    text.write_text("to be, or not to be, that is the question. " * 40)
    run = tmp_path / "runs" / "tiny"
    (run / "ckpt").mkdir(parents=True)
    config = dict(n_layer=2, n_head=2, n_embd=32, block_size=32, attn="emulate", fix="off",
                  precision="paper", seed=0, data=str(text))
    (run / "config.json").write_text(json.dumps(config))
    (run / "summary.json").write_text(json.dumps(dict(collapsed=True, collapse_step=20)))
    (run / "log.csv").write_text("step,train_loss\n10,3.0\n")
    vocab = len(set(text.read_text()))
    model = GPT(GPTConfig(vocab_size=vocab, block_size=32, n_layer=2, n_head=2, n_embd=32))
    for step in (10, 20, 30):
        torch.save({"model": model.state_dict(), "state": {"step": step}}, run / "ckpt" / f"step_{step:07d}.pt")

    checkpoint = mechanism.pick_checkpoint([load_run(run)])
    assert checkpoint.name == "step_0000010.pt"  # the last one before the collapse at step 20
    figures = []
    lines = mechanism.checkpoint_section(mechanism.emulate_attention, "cpu", checkpoint, tmp_path, figures)
    assert figures and figures[0].stat().st_size > 0
    assert "L0 " in lines[0] and "L1 " in lines[0]
