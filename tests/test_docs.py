"""README.md's numbers and tables against the committed files they come from (analyze.py regenerates them)."""

import json
import re
from pathlib import Path

import numpy as np

import analyze
import train
from nanolp.runs import load_run, read_table, study_runs


def test_doc_tables_are_generated_from_their_runs_csv():
    """Each block of README.md, results/README.md and docs/findings.md marked with a runs.csv is regenerated from it
    (python analyze.py --table), never typed: README's table and run commands, results/README.md's table of every
    run, findings' stochastic-rounding table."""
    root = Path(analyze.__file__).parent
    blocks = []
    for doc in analyze.DOCS:
        text = (root / doc).read_text()
        for kind, table in re.findall(r"<!-- (table|all runs|commands): python analyze.py --table ([^>]+) -->\n", text):
            lines = analyze.BLOCKS[kind](analyze.table_rows([root / csv for csv in table.split()]))
            block = text.split(f"<!-- {kind}: python analyze.py --table {table} -->\n")[1]
            assert block.split(f"<!-- end of {kind} -->")[0] == "\n".join(lines) + "\n", (doc, kind, table)
            blocks.append((doc, kind, table))
    seed, stochastic = "results/seed_study/runs.csv", "results/stochastic_rounding/runs.csv"
    shipped = f"{seed} results/modern_block/runs.csv"   # README's: the kernel as it ships, in both studies
    assert {("README.md", "table", shipped), ("README.md", "commands", shipped), ("results/README.md", "all runs", seed),
            ("docs/findings.md", "table", stochastic)} <= set(blocks)


def test_readme_table_is_one_row_per_command_of_the_kernel_as_it_ships():
    """Four commands (off, on, paper, the fp32 control), six columns; the headline draws those arms and no other."""
    root = Path(analyze.__file__).parent
    rows = read_table(root / "results/seed_study/runs.csv")
    lines = analyze.shipped_table(analyze.table_rows([root / "results/seed_study/runs.csv"]))
    commands = [line.split(" | ")[0].strip("|` ") for line in lines[2:] if line.startswith("| `")]
    assert commands == ["python train.py --fix off", "python train.py --fix on", "python train.py --fix paper",
                        "python train.py --attn fp32"]
    assert all(line.count("|") == 7 for line in lines[:2 + len(commands)])   # at most 6 columns
    study = study_runs(root / "results/seed_study/runs.csv")
    shipped = [run for run in study if analyze.as_shipped({**run.config, **run.summary})]
    assert sorted(analyze.command(name) for name in analyze.by_arm(shipped)) == sorted(commands)
    assert all(len(analyze.by_flags([row])) == 1 and row["exponent"] for row in rows if analyze.as_shipped(row))


def test_readme_numbers_are_their_files():
    """README's numbers outside the generated blocks, each against the file it cites; its length and commit hashes."""
    root = Path(analyze.__file__).parent
    text = (root / "README.md").read_text()
    readme = " ".join(text.split())
    assert len(text.splitlines()) <= 150
    assert len(set(re.findall(r"\b[0-9a-f]{7}\b", readme))) <= 2
    study = root / "results/seed_study"
    rows = read_table(study / "runs.csv")
    val = [row["final_val_loss"] for row in rows if row["arm"] == "on"]
    assert f"val loss rises to {min(val):.1f}-{max(val):.1f} nats at the end of the fix-on runs" in readme
    off = [load_run(study / "runs" / row["name"]) for row in rows
           if analyze.as_shipped(row) and row["flags"] == "--fix off" and row["log_kept"]]
    at_10k = [float(np.interp(10_000, *run.series(analyze.LOGIT))) for run in off]
    assert len(off) >= 2 and 10 <= min(at_10k) and max(at_10k) <= 30 and "sits at 10-30" in readme
    assert all(1e8 <= analyze.peak_logit(run) <= 1e9 for run in off) and "on to 1e8-1e9" in readme
    # the modern block: rotary positions against learned ones on the same seed
    rope = next(row for row in read_table(root / "results/modern_block/runs.csv") if row["name"] == "rope-s0")
    learned = next(row for row in rows if row["name"] == "off-fma-s0")
    peak = analyze.peak_logit(load_run(root / "results/modern_block/runs/rope-s0"))
    assert not rope["collapsed"] and rope["seed"] == learned["seed"] == 0 and learned["collapsed"]
    assert f"seed 0 trained {rope['steps']:,} steps without a collapse (layer 0 at most {peak:.1f}), where learned " \
           f"positions collapsed at {learned['collapse_step']:,}" in readme
    # the late stage: the fork's step, and how long each exponent trained past it
    late = {row["name"]: row for row in read_table(root / "results/late_stage/runs.csv")}
    fork = int(json.loads((root / "results/late_stage/runs/torch/config.json").read_text())["forked_from"].split("@")[1])
    assert late["fma"]["collapsed"] and not late["torch"]["collapsed"] and not late["sdpa-flash"]["collapsed"]
    assert f"(step {fork:,}), the exponent as FlashAttention-2 ships it (one fused multiply-add) collapsed " \
           f"{late['fma']['collapse_step'] - fork:,} steps later" in readme
    assert f"trained {min(late['torch']['steps'], late['sdpa-flash']['steps']) - fork:,} more steps" in readme
    # the CPU smoke run's times, and the training step's speed against cuDNN's
    times = [float(line.split()[1]) for line in (root / "results/speed/tiny_cpu.txt").read_text().splitlines()
             if line[:1].isdigit()]
    assert f"{min(times):.0f}-{max(times):.0f} s in {['', 'one', 'two', 'three', 'four', 'five', 'six'][len(times)]} " \
           "runs" in readme and "59-82 s on two idle cores" in (root / "results/speed/tiny_cpu.txt").read_text()
    suite = [float(line.split()[1]) / 60 for line in (root / "results/speed/tiny_cpu.txt").read_text().splitlines()
             if line.startswith("suite_s")]
    assert f"CPU only: {min(suite):.0f}-{max(suite):.0f} minutes on a 2-core machine" in readme
    speed = {row["name"]: row["tokens_per_s"] for row in read_table(root / "results/speed/train_step/runs.csv")}
    assert f"steps at {speed['fix-on-8000'] / speed['sdpa-8000']:.2f}x the tokens/s of `--attn sdpa`" in readme
    # the kernel against torch's flash backend, forward+backward, at every shape of the benchmark
    bench = read_table(root / "results/speed/bench.csv")
    ms = {(row["impl"], row["head_dim"], row["seq"]): row["fwd_bwd_ms"] for row in bench}
    ratios = [ms["sdpa_flash", D, N] / t for (impl, D, N), t in ms.items() if impl == "ours_fix"]
    assert len(ratios) == 8 and f'(`fix="on"`: {min(ratios):.2f}-{max(ratios):.2f}x)' in readme
    # the settings it names: train.py's
    d, tiny = train.PRESETS["default"], train.PRESETS["tiny"]
    assert (f"({d['n_layer']} layers, {d['n_head']} heads, {d['n_embd']} channels, context {d['block_size']}, batch "
            f"{d['batch_size']}, lr {d['lr']:g}, bf16, TinyShakespeare)") in readme and d["dtype"] == "bf16"
    assert f"smoothed loss more than {train.SPIKE_NATS:g} nat above its minimum" in readme
    assert f"`--steps` ({d['steps']:,} by default" in readme
    assert f"trains a {tiny['n_layer']}-layer model for {tiny['steps']} steps" in readme
