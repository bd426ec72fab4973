"""The numbers and tables of README.md, docs/findings.md and docs/kernel.md ("Speed", "Correctness evidence")
against the committed files they come from (analyze.py regenerates the tables)."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

import analyze
import kernels
import train
from experiments import bench
from experiments.onset import log_rows
from experiments.sweep import load_study
from nanolp.probe import pool as probe_pool, pooled_checkpoints
from nanolp.runs import load_run, read_table, study_runs


def test_doc_tables_are_generated_from_their_runs_csv():
    """Each block of README.md, results/README.md and docs/findings.md marked with a runs.csv is regenerated from it
    (python analyze.py --table), never typed: README's table and run commands, results/README.md's tables of every
    run and of the modern block, findings' stochastic-rounding, modern-block, learning-rate and memorisation tables.
    Every --table marker must parse and close, so none is passed over."""
    root = Path(analyze.__file__).parent
    blocks = []
    kinds = "|".join(map(re.escape, analyze.BLOCKS))
    for doc in analyze.DOCS:
        text = (root / doc).read_text()
        markers = [line for line in text.splitlines() if line.startswith("<!--") and "analyze.py --table" in line]
        found = re.findall(rf"^<!-- ({kinds}): python analyze.py --table ([^>]+) -->$", text, re.M)
        assert len(found) == len(markers), (doc, markers)
        for kind, table in found:
            lines = analyze.BLOCKS[kind](analyze.table_rows([root / csv for csv in table.split()]))
            block = text.split(f"<!-- {kind}: python analyze.py --table {table} -->\n")[1]
            assert f"<!-- end of {kind} -->" in block, (doc, kind, table)
            assert block.split(f"<!-- end of {kind} -->")[0] == "\n".join(lines) + "\n", (doc, kind, table)
            blocks.append((doc, kind, table))
    seed, stochastic = "results/seed_study/runs.csv", "results/stochastic_rounding/runs.csv"
    shipped = f"{seed} results/cure/runs.csv results/modern_block/runs.csv"   # README's: the kernel as it ships
    modern, corpus, lr = "results/modern_block/runs.csv", "results/memorisation/runs.csv", "results/lr_sweep/runs.csv"
    assert sorted(blocks) == sorted([
        ("README.md", "commands", shipped), ("README.md", "table", shipped),
        ("results/README.md", "all runs", seed), ("results/README.md", "all runs", lr),
        ("results/README.md", "all runs", corpus), ("results/README.md", "table", modern),
        ("docs/findings.md", "table", stochastic), ("docs/findings.md", "table", modern),
        ("docs/findings.md", "by lr", f"{lr} {shipped}"), ("docs/findings.md", "losses", corpus)])


def test_readme_table_is_one_row_per_command_of_the_kernel_as_it_ships():
    """Four commands (off, on, paper, the fp32 control), six columns; the headline draws those arms and no other."""
    root = Path(analyze.__file__).parent
    rows = read_table(root / "results/seed_study/runs.csv")
    lines = analyze.shipped_table(analyze.table_rows([root / "results/seed_study/runs.csv"]))
    commands = [line.split(" | ")[0].strip("|` ") for line in lines[2:] if line.startswith("| `")]
    assert commands == ["python train.py --fix off", "python train.py --fix paper --delta fp32-o",
                        "python train.py --fix paper", "python train.py --attn fp32"]
    assert all(line.count("|") == 7 for line in lines[:2 + len(commands)])   # at most 6 columns
    study = study_runs(root / "results/seed_study/runs.csv")
    shipped = [run for run in study if analyze.as_shipped({**run.config, **run.summary})]
    assert sorted(analyze.command(name) for name in analyze.by_arm(shipped)) == sorted(commands)
    assert all(list(analyze.rows_by_arm([row])) == [row["arm"]] and row["exponent"] for row in rows
               if analyze.as_shipped(row))


def test_readme_numbers_are_their_files():
    """README's numbers outside the generated blocks, each against the file it cites; its length and commit hashes."""
    root = Path(analyze.__file__).parent
    text = (root / "README.md").read_text()
    readme = " ".join(text.split())
    assert len(text.splitlines()) <= 150
    assert len(set(re.findall(r"\b[0-9a-f]{7}\b", readme))) <= 2
    study = root / "results/seed_study"
    rows = read_table(study / "runs.csv")
    cure = read_table(root / "results/cure/runs.csv")   # (--fix on reads the fp32 O whatever the delta column says)
    rounding = read_table(root / "results/stochastic_rounding/runs.csv")
    val = [row["final_val_loss"] for row in rows + cure + rounding
           if (row["delta"] == "fp32-o" or row["fix"] == "on") and row["log_kept"]]
    assert f"val loss rises to {min(val):.1f}-{max(val):.1f} nats in the runs that read delta from the " \
           "fp32 O" in readme
    off = [load_run(study / "runs" / row["name"]) for row in rows
           if analyze.as_shipped(row) and row["flags"] == "--fix off" and row["log_kept"]]
    at_10k = [float(np.interp(10_000, *run.series(analyze.LOGIT))) for run in off]
    assert len(off) >= 2 and f"sits at {min(at_10k):.0f}-{max(at_10k):.0f}" in readme   # at step 10,000, as findings
    assert all(1e8 <= analyze.peak_logit(run) <= 1e9 for run in off) and "on to 1e8-1e9" in readme
    # the loss as the model memorises (the median run's lowest, to 0.01), and a uniform guess's over the vocabulary
    fixed = [load_run(root / "results/cure/runs" / row["name"]) for row in cure if row["log_kept"]]
    floor = lambda runs: np.median([np.nanmin(run.series("train_loss")[1]) for run in runs])
    assert f"The loss falls to ~{floor(off):.2f} as the model memorises" in readme
    assert f"`max_logit_L0` stays in the tens (the table's last column) and the loss at ~{floor(fixed):.2f}" in readme
    (vocab,) = {run.config["vocab_size"] for run in off + fixed}
    assert f"(uniform: ln {vocab} = {np.log(vocab):.2f})" in readme
    # the cure's runs on an H100 (its runs.csv's gpu column)
    named = re.search(r"`--fix on`'s seeds ([\d, and-]+) on an H100", readme)[1]
    seeds = [n for part in re.split(r", | and ", named)
             for n in range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1)]
    assert seeds == [row["seed"] for row in cure if "H100" in row["gpu"]]
    # the kernel's head_dims (its tunings') and the GPUs whose shared memory each launch was compiled against
    assert f"head_dim {'/'.join(map(str, kernels.FWD_TUNING))}, any sequence length" in readme
    ampere_ada = [arch for arch in shared_limit(root) if arch < 90]
    assert f"(sm_{min(ampere_ada)}-{max(ampere_ada)}), untested there" in readme
    # the modern block: rotary positions and QK-norm against GPT-2's block on the same seeds
    learned = {row["seed"]: row for row in rows if row["name"].startswith("off-fma-s")}
    for runs in modern_block_runs(root).values():   # (their peaks: README's table)
        assert runs and all(not row["collapsed"] and row["steps"] == 200_000 and learned[row["seed"]]["collapsed"]
                            for row in runs)
    assert "rotary positions and QK-norm on the seeds where GPT-2's block collapsed: " \
           "`results/modern_block/figures/headline.png`" in readme
    # the learning rate: the lr study's runs of seed 0, every layer past 100 at the first diagnostic at 1e-2
    lr = {row["name"]: row for row in read_table(root / "results/lr_sweep/runs.csv")}
    high = [load_run(root / "results/lr_sweep/runs" / name) for name in lr if "lr1e-2" in name]
    first = lambda s: int(s[0][np.argmax(s[1] > 100)]) if np.nanmax(s[1]) > 100 else np.inf   # the step past 100
    past = [first(s) for run in high for s in map(run.series, run.columns(r"max_logit_L\d+"))]
    assert len(high) == 5 and max(past) == 1_000   # (the first diagnostic; three attentions, rotary in bf16 and fp32)
    later = [lr[f"off-lr3e-3-s{seed}"] for seed in (1, 2)]   # the fix off's other seeds at 3e-3
    assert f"The learning rate (seed 0 unless named): at 3e-3 `--fix off` collapsed at step " \
           f"{lr['off-lr3e-3-s0']['collapse_step']:,} (seeds 1 and 2 not in {later[0]['steps']:,} steps, their " \
           f"layer 0 past 100), `--fix on` on none of seeds 0-2 (its layer 0 slower), rotary positions not in " \
           f"{lr['rope-lr3e-3-s0']['steps']:,}; at 1e-2 every " \
           f"attention's logits passed 100 by step 1,000, bf16 attention collapsed (fix off at " \
           f"{lr['off-lr1e-2-s0']['collapse_step']:,}, fix on " \
           f"at {lr['on-lr1e-2-s0']['collapse_step']:,}, rotary positions at " \
           f"{lr['rope-lr1e-2-s0']['collapse_step']:,}), fp32 not (in {lr['fp32-lr1e-2-s0']['steps']:,} steps, with " \
           "either block)" in readme and lr['fp32-lr1e-2-s0']['steps'] == lr['rope-fp32-lr1e-2-s0']['steps']
    assert lr["on-lr3e-3-s0"]["steps"] == lr["rope-lr3e-3-s0"]["steps"]
    # the fix at 3e-3 on seeds 0-2: no collapse, layer 0 past 100 later than the fix off's of the same seed, or never
    layer0 = lambda name: load_run(root / "results/lr_sweep/runs" / name).series(analyze.LOGIT)
    assert all(not lr[f"on-lr3e-3-s{seed}"]["collapsed"] and first(layer0(f"on-lr3e-3-s{seed}")) >
               first(layer0(f"off-lr3e-3-s{seed}")) for seed in range(3))
    assert all(not row["collapsed"] and row["steps"] == later[0]["steps"] and np.nanmax(load_run(
        root / "results/lr_sweep/runs" / row["name"]).series(analyze.LOGIT)[1]) > 100 for row in later)
    assert not lr["on-lr3e-3-s0"]["collapsed"] and not lr["rope-lr3e-3-s0"]["collapsed"]
    assert not any(lr[name]["collapsed"] for name in lr if "lr1e-2" in name and lr[name]["attn"] == "fp32")
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
           "runs" in readme
    suite = [float(line.split()[1]) / 60 for line in (root / "results/speed/tiny_cpu.txt").read_text().splitlines()
             if line.startswith("suite_s")]
    assert f"the tests, CPU only: {min(suite):.0f}-{max(suite):.0f} minutes on a 2-core machine" in readme
    # the kernel against torch's flash backend, forward+backward, at every shape of the benchmark
    ms = {(row["impl"], row["head_dim"], row["seq"]): row["fwd_bwd_ms"]
          for row in read_table(root / "results/speed/bench_h100.csv")}
    ratios = [ms["sdpa_flash", D, N] / t for (impl, D, N), t in ms.items() if impl == "ours_fix"]
    assert len(ratios) == 12 and f"it ran {min(ratios):.2f}-{max(ratios):.2f}x torch's flash backend" in readme
    # the fix's cost: fix_cost.csv's paired rounds, forward+backward, below seq 4k and from it
    short, long = fix_cost(root)
    assert f"costs {min(short):+.1f}% to {max(short):+.1f}% of forward+backward at seq 256-2k, at most " \
           f"{max(long):+.1f}% from 4k" in readme
    # the settings it names: train.py's
    d, tiny = train.PRESETS["default"], train.PRESETS["tiny"]
    assert (f"({d['n_layer']} layers, {d['n_head']} heads, {d['n_embd']} channels, context {d['block_size']}, batch "
            f"{d['batch_size']}, lr {d['lr']:g}, bf16, TinyShakespeare)") in readme and d["dtype"] == "bf16"
    assert f"smoothed loss more than {train.SPIKE_NATS:g} nat above its minimum" in readme
    assert f"`--steps` ({d['steps']:,} by default" in readme
    assert f"Without a GPU ({tiny['n_layer']} layers, {tiny['steps']} steps" in readme


def test_kernel_md_memory_is_the_runs():
    """docs/kernel.md's peak memory of the fix and of the fix off: the kernel as it ships, every run of each alike."""
    root = Path(analyze.__file__).parent
    on = {row["peak_mem_gb"] for row in read_table(root / "results/cure/runs.csv")}
    off = {row["peak_mem_gb"] for row in read_table(root / "results/seed_study/runs.csv") if row["arm"] == "off-fma"}
    assert max(on) - min(on) < 0.005 and max(off) - min(off) < 0.005   # alike to within a few MB
    kernel_md = " ".join((root / "docs/kernel.md").read_text().split())
    assert f"peak memory {analyze.between(on, '.2f')} GB with `--fix on` against {analyze.between(off, '.2f')} GB " \
           "with the fix off" in kernel_md


def test_kernel_md_gpu_tests_are_their_file():
    """docs/kernel.md's count of the kernel tests on the GPU is the latest whole run's in results/speed/gpu_tests.txt,
    the CUDA-graphs step after it (`-k cuda_graphs`) passed, README points to that run's commit, and a run of a few since
    (`-k`, deselecting the rest) is named with its count, where the file has one."""
    root = Path(analyze.__file__).parent
    blocks = (root / "results/speed/gpu_tests.txt").read_text().split("# earlier:")   # the latest first
    summaries = lambda block: re.findall(r"^(?=\d+ (?:failed|passed))(?:(\d+) failed)?(?:, )?(?:(\d+) passed)?"
                                         r"(?:, \d+ skipped)?(, \d+ deselected)?", block, re.M)   # pytest's last line
    whole = next(i for i, block in enumerate(blocks) if not summaries(block)[0][2])
    (failed, passed, _), *after = summaries(blocks[whole])
    kernel_md = " ".join((root / "docs/kernel.md").read_text().split())
    counts = f"{passed} passed and {failed} failed" if failed else f"{passed} passed, none failed"
    assert f"at the commit it names, {counts} (`results/speed/gpu_tests.txt`" in kernel_md
    # the whole run's own CUDA-graphs step, next in its block: one test, the rest deselected, passed
    assert "# then python -m pytest -q tests/test_train.py -k cuda_graphs" in blocks[whole]
    assert [(step_failed, step_passed, bool(deselected)) for step_failed, step_passed, deselected in after] == \
        [("", "1", True)]
    assert "and the compiled training step under CUDA graphs passed" in kernel_md
    assert re.search(r"^# one .*, at [0-9a-f]{7},", blocks[whole], re.M)   # the commit README points to
    assert "the GPU kernel tests passed on an H100 at the commit `results/speed/gpu_tests.txt` names" in \
        " ".join((root / "README.md").read_text().split())
    if whole:
        failed, passed, _ = summaries(blocks[0])[0]
        assert not failed and f"({passed} passed, none failed)" in kernel_md


def test_results_readme_names_the_seed_studys_runs_not_made(tmp_path):
    """results/README.md's seed study: the runs its declaration holds that results/seed_study/runs/ lacks (those
    `python -m experiments.sweep seed_study` would start), by arm and seed."""
    from experiments import sweep
    root = Path(analyze.__file__).parent
    study = sweep.load_study(sweep.STUDIES, "seed_study")
    todo = {}
    for run in sweep.plan(study, tmp_path / "none", root / "results/seed_study"):
        if run["state"] != "collected":
            todo.setdefault(run["arm"], []).append(run["seed"])
    assert todo == {"off": [0, 1, 4, 5, 6, 7], "paper": [0, 1], "sdpa-flash": [0, 1, 2, 3], "sdpa": [0, 1, 2, 3],
                    "paper-precision-on": [0, 1, 2, 3], "paper-precision-delta-from-p": [0, 1, 2, 3],
                    "attn-fp32": [3]}
    text = doc_section("results/README.md", "## seed_study/", "| file |")
    assert f"As declared it also holds {sum(map(len, todo.values()))} runs not made" in text
    for arm, seeds in todo.items():   # "`off` seeds 0-1 and 4-7", "`sdpa-flash` and `sdpa` 0-3"
        assert re.search(rf"`{arm}`(?: and `[\w-]+`)*(?: on)?(?: seeds?)? {seed_ranges(seeds)}\b", text), (arm, seeds)


def seed_ranges(seeds):
    """[0, 1, 4, 5, 6, 7] -> "0-1 and 4-7", [3] -> "3": runs of consecutive seeds."""
    runs = [[seeds[0]]]
    for seed in seeds[1:]:
        runs[-1].append(seed) if seed == runs[-1][-1] + 1 else runs.append([seed])
    return listed([f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs])


def seeds_text(seeds):
    """[0] -> "seed 0", [0, 1, 2] -> "seeds 0-2" (consecutive seeds, as the studies run them)."""
    assert seeds == list(range(seeds[0], seeds[-1] + 1)), seeds
    return f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}"


def listed(items):
    """["a"] -> "a", ["a", "b", "c"] -> "a, b and c"."""
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def modern_block_runs(root):
    """results/modern_block/runs.csv's rows by arm, in seed order."""
    rows = sorted(read_table(root / "results/modern_block/runs.csv"), key=lambda row: row["seed"])
    return {arm: [row for row in rows if row["arm"] == arm] for arm in ("rope", "qk-norm")}


def test_findings_modern_block_numbers_are_their_files():
    """docs/findings.md's section on a modern block against its runs' logs (layer 0's logit, the norms, the gains,
    the sharp rows) and the probe's pooled phases: a run added or replaced, or the probe rerun, shows here."""
    root = Path(analyze.__file__).parent
    text = " ".join((root / "docs/findings.md").read_text().split("## 8. ")[1].split("## 9. ")[0].split())
    diag = lambda run: {int(r["step"]): {k: float(v) for k, v in r.items() if v} for r in log_rows(run)
                        if r.get("max_logit_L0")}
    # the answer: which seeds ran, none collapsed, GPT-2's block collapsed on each; the seeds still to run
    gpt2 = {row["seed"]: row for row in read_table(root / "results/seed_study/runs.csv")
            if row["name"].startswith("off-fma-s")}
    runs = modern_block_runs(root)
    assert all(not row["collapsed"] and gpt2[row["seed"]]["collapsed"] for arm in runs.values() for row in arm)
    seeds = {arm: [row["seed"] for row in rows] for arm, rows in runs.items()}
    assert f"200,000 steps (rotary positions: {seeds_text(seeds['rope'])}; QK-norm: {seeds_text(seeds['qk-norm'])})" \
           in text
    left = {arm: sorted(set(declared) - set(seeds[arm]))
            for arm, (_, declared) in load_study(root / "results/studies.toml", "modern_block").arms.items()}
    still = " and ".join(f"{seeds_text(left[arm])} of {option}" for arm, option in
                         (("rope", "rotary positions"), ("qk-norm", "QK-norm")) if left[arm])
    verb = "is" if sum(map(len, left.values())) == 1 else "are"
    assert (f"{still[:1].upper()}{still[1:]} {verb} still to run." in text) if still else "still to run" not in text
    grew = lambda log, col, end=None: f"{log[10_000][col]:.3g} -> {log[end or max(log)][col]:.3g}"
    logit = lambda log, step: log[step]["max_logit_L0"]
    peak = lambda log: max(row["max_logit_L0"] for row in log.values())
    # rotary positions, per seed: layer 0's logit and W_Q's and W_K's norms against the complete fix's
    ropes = [diag(root / "results/modern_block/runs" / row["name"]) for row in runs["rope"]]
    assert f"max logit {listed([f'{logit(log, 10_000):.1f}' for log in ropes])} at step 10,000 on " \
           f"seed{'s' * (len(ropes) > 1)} {listed([str(seed) for seed in seeds['rope']])} and at most " \
           f"{listed([f'{peak(log):.1f}' for log in ropes])}" in text
    # over the same steps as the fix's runs of the same seeds (150,000), then to rope's end
    fixed = [diag(root / f"results/cure/runs/on-s{seed}") for seed in seeds["rope"]]
    norm = lambda log, step, col: f"{log[step][col]:.3g}"
    both = lambda log, step: f"{norm(log, step, 'sn_q_L0')} and {norm(log, step, 'sn_k_L0')}"
    span = lambda logs: ", ".join(f"{grew(log, 'sn_q_L0', 150_000)} and {grew(log, 'sn_k_L0', 150_000)}"
                                  for log in logs)
    assert f"from step 10,000 to 150,000, {span(ropes)} on seeds {listed([str(s) for s in seeds['rope']])} (at " \
           f"200,000: {', '.join(both(log, 200_000) for log in ropes)}), `--fix on`'s on the same seeds " \
           f"{span(fixed)}." in text and all(max(log) == 200_000 for log in ropes)
    # the probe: rope over all its checkpoints, QK-norm before its doublings, GPT-2's block before its doubling
    probe = {(row["arm"], row["phase"], row["term"]): row
             for row in read_table(root / "results/delta_probe/probe_phases.csv") if row["probe_batches"] == "train"}
    cell = lambda row, t=".1f": f"{row['mean']:+.1e}, t {row['t']:+{t}}"
    off, rope_total, qk_total = probe["--fix off", 1, "total"], probe["--fix off --pos rope", 1, "total"], \
        probe["--fix off --qk-norm", 1, "total"]
    assert ("--fix off --pos rope", 2, "total") not in probe and rope_total["runs"] == len(ropes)
    assert all(max(log) == rope_total["last_step"] for log in ropes)   # every checkpoint of every run: phase 1
    by_seed = {row["run"]: row for row in read_table(root / "results/delta_probe/probe_runs.csv")
               if row["probe_batches"] == "train" and row["term"] == "total"}
    each = listed([f"{by_seed['results/modern_block/runs/' + row['name']]['t']:+.1f}" for row in runs["rope"]])
    pooled = {2: "both", 3: "the three"}[len(ropes)]
    assert f"over {pooled} seeds' {rope_total['checkpoints']} checkpoints the probe " \
           f"finds total {cell(rope_total)} (seed by seed t {each}), {off['mean'] / rope_total['mean']:.0f}x less " \
           f"than GPT-2's block before its doubling (four seeds: {cell(off)})" in text and off["runs"] == 4
    curv, lin, off_curv = (probe["--fix off --pos rope", 1, "curv"]["mean"], probe["--fix off --pos rope", 1, "lin"],
                           probe["--fix off", 1, "curv"]["mean"])
    sign = "negative" if lin["t"] < -2 else "positive" if lin["t"] > 2 else "within two standard errors of zero"
    assert f"{off_curv / curv:.0f}x smaller ({curv:+.1e} against {off_curv:+.1e}) and its linear term is {sign} " \
           f"({lin['mean']:+.1e}, t {lin['t']:+.1f})" in text
    rope_runs = [load_run(root / "results/modern_block/runs" / row["name"]) for row in runs["rope"]]
    def early(term):   # rope's pooled term over the fix off's steps alone (its phase 1 ends by off["last_step"])
        steps, _, means, ses, _ = pooled_checkpoints(rope_runs, term)
        keep = steps <= off["last_step"]
        return (*probe_pool(means[keep], ses[keep]), int(keep.sum()))
    total, _, t, n = early("total")
    assert f"Over the fix off's steps alone ({off['first_step']:,}-{off['last_step']:,}: {n} checkpoints) its total " \
           f"is {total:+.1e}, t {t:+.1f}, {off['mean'] / total:.0f}x less, and its curvature term " \
           f"{off_curv / early('curv')[0]:.0f}x smaller" in text
    assert f"steps {qk_total['first_step']:,}-{qk_total['last_step']:,}: total {cell(qk_total)}; curvature term " \
           f"{cell(probe['--fix off --qk-norm', 1, 'curv'], '.0f')}" in text
    # QK-norm, per seed: the logit against its gains, when it doubled, and the sharp rows
    qks = [diag(root / "results/modern_block/runs" / row["name"]) for row in runs["qk-norm"]]
    doubled = [next(step for step, row in qk.items() if row["max_logit_L0"] > 2 * logit(qk, 10_000)) for qk in qks]
    gains = lambda row: (row["gain_q_L0"], row["gain_k_L0"])
    assert all(row["max_logit_L0"] <= 8 * np.prod(gains(row)) for qk in qks for row in qk.values())  # sqrt(64) g_q g_k
    assert probe["--fix off --qk-norm", 2, "total"]["first_step"] == min(doubled)
    assert f"W_Q's norm grows ({listed([grew(qk, 'sn_q_L0') for qk in qks])})" in text
    went = [f"from {logit(qk, 10_000):.1f} to {qk[max(qk)]['max_logit_L0']:.1f} on seed {seed} (gains "
            f"{qk[10_000]['gain_q_L0']:.2f} -> {qk[max(qk)]['gain_q_L0']:.2f} and {qk[max(qk)]['gain_k_L0']:.2f})"
            for seed, qk in zip(seeds['qk-norm'], qks)]
    assert f"layer 0's max logit went {listed(went)}, doubling at steps {listed([f'{s:,}' for s in doubled])}, at " \
           f"150,000 {listed([f'{logit(qk, 150_000) / logit(qk, 10_000):.1f}x' for qk in qks])} its step-10,000 " \
           f"value" in text
    at_150k = [v[s == 150_000][0] / v[s == 10_000][0] for run in (root / "results/seed_study/runs").glob("paper-fp32-o-s*")
               for s, v in [load_run(run).series(analyze.LOGIT)]]
    assert f"where the runs of the paper's rule with the fp32 O drift {analyze.between(at_150k, '.2f')}x" in text
    # the seeds on which it passed 100 and trained on, against GPT-2's block's collapse on each
    past = {seed: (min(over), peak(qk)) for seed, qk in zip(seeds["qk-norm"], qks)
            if (over := [s for s, r in qk.items() if r["max_logit_L0"] > 100])}
    if past:
        many = len(past) > 1
        firsts = [f"{step:,}" for step, _ in past.values()]
        peaks = [f"{top:.1f}" for _, top in past.values()]
        collapses = [f"{gpt2[seed]['collapse_step']:,}" for seed in past]
        assert f"On seed{'s' * many} {listed([str(seed) for seed in past])} it passed 100 (at step{'s' * many} " \
               f"{listed(firsts)}, peaking at {listed(peaks)}) and the loss trained " \
               f"on; GPT-2's block collapsed on {'those seeds' if many else 'that seed'} at step{'s' * many} " \
               f"{listed(collapses)}." in text
    else:
        assert "it passed 100" not in text
    sharp = [row["sharp_rate_L0"] for qk in qks for step, row in qk.items() if step >= 10_000]
    learned = [row["sharp_rate_L0"] for run in sorted((root / "results/seed_study/runs").glob("off-fma-s*"))
               for log in [diag(run)] for step, row in log.items()
               if step <= next(s for s in log if log[s]["max_logit_L0"] > 2 * logit(log, 10_000))]
    assert f"{100 * min(sharp):.0f}-{100 * max(sharp):.0f}% of layer 0's rows are sharp (GPT-2's block: at " \
           f"most {100 * max(learned):.2f}% before the doubling)" in text


def doc_section(doc, heading, until):
    """The whitespace-normalised text of a doc from a heading to the next one named (or the end)."""
    text = (Path(analyze.__file__).parent / doc).read_text().split(heading)[1]
    return " ".join((text.split(until)[0] if until else text).split())


def sci(value, digits=1):
    """3.4e-03 -> "3.4e-3", 4.9e+05 -> "4.9e5": the docs' spelling of a power of ten."""
    mantissa, exponent = f"{value:.{digits}e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def onset_lines(path):
    """experiments/onset.py's per-run lines (onset.txt: layer 0's step-10,000 logit, when it doubled and passed 100,
    the sharp rate's largest before the doubling, the tie rate's range) by run; the lines of runs whose logs were not
    kept can only be read, not recomputed."""
    runs = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"(\S+)\s+base\s+(\S+)\s+2x at (\S+)\s+>100 at (\S+)\s+sharp rate up to 2x: mean \S+ max (\S+).*"
                     r"tie rate 5k-30k (\S+)-(\S+)$", line)
        if m:
            name, base, doubled, past, sharp, tie_low, tie_high = m.groups()
            step = lambda cell: None if cell == "None" else int(cell)
            runs[name] = dict(base=float(base), doubled=step(doubled), past_100=step(past), sharp=float(sharp),
                              ties=(float(tie_low), float(tie_high)))
    return runs


def late_lines(path):
    """experiments/onset.py --late's lines (late_stage.txt) by run: the steps from 1e6 to the collapse or the end, and
    layer 0's last logged max logit."""
    runs = {}
    for line in Path(path).read_text().splitlines():
        m = re.match(r"(\S+)\s+>1e3 at .*1e6->(collapse|end) (\S+)\s+last (\S+)", line)
        if m:
            after = None if m[3] == "-" else int(m[3].replace(",", ""))
            runs[m[1]] = dict(collapsed=m[2] == "collapse", after_1e6=after, last=float(m[4]))
    return runs


def fix_off(row):
    """A seed-study row of the fix off with the plain kernel: the earlier kernels' `off` and the shipped `off-fma`."""
    return row["arm"] in ("off", "off-fma")


def test_findings_words_numbers_are_their_files():
    """The default run's settings as findings' "Words" give them (train.py's preset, a run's config.json), and the
    tokens/s of a run alone and of two side by side (the seed study's runs.csv)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "**Words.**", "## 1. ")
    d = train.PRESETS["default"]
    config = json.loads((root / "results/seed_study/runs/off-fma-s0/config.json").read_text())
    assert f"a {d['n_layer']}-layer, {d['n_head']}-head, {d['n_embd']}-dim character GPT on TinyShakespeare " \
           f"({config['vocab_size']} characters), context {d['block_size']}, batch {d['batch_size']}, AdamW " \
           f"({d['beta1']:g}, {d['beta2']:g}), lr {sci(d['lr'], 0)} constant after {d['warmup']} warmup steps, clip " \
           f"{d['grad_clip']:.1f}, bf16 autocast" in text and config["grad_clip"] == d["grad_clip"]
    assert f"training loss {train.SPIKE_NATS:g} nat above its running minimum" in text
    rows = [row for row in read_table(root / "results/seed_study/runs.csv") if row["minutes"] and row["tokens_per_s"]]
    pace = lambda row: row["steps"] / row["minutes"]   # analyze.ALONE_PACE: faster than this, the run was alone
    alone = np.median([row["tokens_per_s"] for row in rows if pace(row) > analyze.ALONE_PACE])
    shared = np.median([row["tokens_per_s"] for row in rows if pace(row) <= analyze.ALONE_PACE])
    assert f"(~{alone / 1e6:.0f}M tokens/s; two side by side get ~{shared / 1e6:.1f}M each)" in text


def test_findings_failure_numbers_are_their_files():
    """Section 1 (what fails): the losses, layer 0's logit at step 10,000 and at the collapse, the other layers'
    logits where layer 0 stays flat, against the seed study's runs.csv, onset.txt and logs."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 1. ", "## 2. ")
    rows = read_table(root / "results/seed_study/runs.csv")
    trained = [row for row in rows if not row["collapsed"]]
    vocab = json.loads((root / "results/seed_study/runs/off-fma-s0/config.json").read_text())["vocab_size"]
    val = [row["final_val_loss"] for row in trained]
    assert f"Train loss falls to ~{np.median([row['final_train_loss'] for row in trained]):.2f} while the val loss " \
           f"passes ln {vocab} = {np.log(vocab):.2f} (a uniform guess) within the first 10,000 steps and ends at " \
           f"{analyze.between(val)} nats" in text
    for run in sorted((root / "results/seed_study/runs").iterdir()):   # every kept log: past ln 65 by step 10,000
        steps, loss = load_run(run).series("val_loss")
        assert steps[np.argmax(loss > np.log(vocab))] <= 10_000, run
    off = [row for row in rows if fix_off(row)]
    onset = onset_lines(root / "results/seed_study/onset.txt")
    decade = lambda value: f"1e{int(np.floor(np.log10(value)))}"
    peaks = [row["max_logit"] for row in off]
    bases = [onset[row["name"]]["base"] for row in off]
    assert f"layer 0's max attention logit sits at {analyze.between(bases, '.0f')}, doubles, and runs away to " \
           f"{decade(min(peaks))}-{decade(max(peaks))} before the collapse" in text
    flat = [row["max_logit"] for row in trained if row["max_logit"] < analyze.RUNAWAY_LOGIT]
    assert f"the other layers' logits grow in every arm, to {analyze.between(flat, '.0f')} where layer 0 stays flat " \
           "in the seed study's runs" in text
    assert all(row["collapsed"] for row in off) and "Fix off collapsed on every seed run, with both kernels" in text
    assert {row["arm"] for row in off} == {"off", "off-fma"}


def test_findings_delta_term_numbers_are_their_files():
    """Section 2 (which term): the slow drift of layer 0 where delta does not read the bf16 O (the logs), the tie
    and sharp rates of the fix-off runs (onset.txt), and the synthetic sharp rows (results/mechanism/sharp_rows.txt)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 2. ", "## 3. ")
    study = root / "results/seed_study/runs"
    def drift(run, until=np.inf):   # layer 0's max logit up to a step, over its value at step 10,000
        steps, logit = load_run(run).series(analyze.LOGIT)
        return logit[steps <= until].max() / logit[steps == 10_000][0]

    fp32 = {int(run.name[-1]): drift(run) for run in sorted(study.glob("attn-fp32-s*"))}
    both = {int(run.name[-1]): drift(run) for run in sorted(study.glob("paper-fp32-o-s*"))}
    cure = read_table(root / "results/cure/runs.csv")
    on = [drift(root / "results/cure/runs" / row["name"], until=150_000) for row in cure]   # the controls' steps
    assert f"(fp32 attention's at most {analyze.between(fp32.values(), '.2f')}x its step-10,000 value on " \
           f"{seeds_text(sorted(fp32))}, the paper's rule with the fp32 O's {analyze.between(both.values(), '.2f')}x " \
           f"on {seeds_text(sorted(both))}: the slow drift is training's; `--fix on`'s " \
           f"{analyze.between(on, '.2f')}x on {seeds_text([row['seed'] for row in cure])} over the same 150,000 " \
           f"steps)" in text
    assert all(row["steps"] >= 150_000 for row in cure)
    rows = read_table(root / "results/seed_study/runs.csv")
    onset = onset_lines(root / "results/seed_study/onset.txt")
    off = [onset[row["name"]] for row in rows if fix_off(row)]
    ties = [100 * rate for run in off for rate in run["ties"]]
    assert f"ties are rare in layer 0 ({analyze.between(ties)}% of its rows with the fix off, steps 5,000-30,000)" \
           in text
    from_p = [row for row in rows if row["arm"] == "delta-from-p"]
    assert len(from_p) == 1 and not from_p[0]["collapsed"]
    assert f"delta from P (`--delta p`, one run: seed {from_p[0]['seed']}, {from_p[0]['steps']:,} steps)" in text
    most = max(run["sharp"] for run in off if run["sharp"] == run["sharp"])   # (NaN: no doubling to count up to)
    assert f"(at most {sci(most)} of layer 0's rows in our fix-off runs until its logit has doubled;" in text
    more = {name: run for name, run in onset.items() if name.startswith("sdpa") and run["sharp"] > most}
    seed = lambda name: int(name.split("-s")[-1].split("-")[0])
    (only,) = {seed(name) for name in more}   # the seed on which torch's backends had more
    flash, cudnn = more[f"sdpa-flash-s{only}-nolog"], more[f"sdpa-s{only}-nolog"]
    assert f"torch's backends had more on seed {only} alone: flash {sci(flash['sharp'])}, cuDNN " \
           f"{sci(cudnn['sharp'])}, its layer 0 at {cudnn['base']:.1f} at step 10,000)" in text
    rows = re.findall(r"1 - p_max\s+(\S+):.*corr\(delta error, dS_max\) (\S+),",
                      (root / "results/mechanism/sharp_rows.txt").read_text())
    exact = [float(eps) for eps, corr in rows if corr == "+1.000"]
    assert exact and all(float(eps) > max(exact) for eps, corr in rows if corr != "+1.000")
    assert f"(corr +1.000 on synthetic rows with eps <= {max(exact):.0e}".replace("e-0", "e-") in text


def test_findings_cure_numbers_are_their_files():
    """Section 3 (what cures it): the cure's run against results/cure/, the seeds still to run against studies.toml,
    the fix's earlier forms against the seed and stochastic-rounding studies' runs.csv."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 3. ", "## 4. ")
    cure = read_table(root / "results/cure/runs.csv")
    gpt2 = {row["seed"]: row for row in read_table(root / "results/seed_study/runs.csv") if row["arm"] == "off-fma"}
    assert [row["seed"] for row in cure] == list(range(len(cure))) and not any(row["collapsed"] for row in cure)
    logit = lambda run: load_run(root / "results" / run).series(analyze.LOGIT)
    at = lambda run, step: logit(run)[1][logit(run)[0] == step][0]
    peak = lambda run: logit(run)[1].max()
    on = [f"cure/runs/{row['name']}" for row in cure]
    both = lambda values: listed(list(values))
    paired = [row['seed'] for row in cure if row['seed'] in gpt2]   # the seeds GPT-2's block ran with the fix off
    collapses = both(format(gpt2[seed]['collapse_step'], ',') for seed in paired)
    on_seeds = "the same seeds" if len(paired) == len(cure) else seeds_text(paired)
    _, declared = load_study(root / "results/studies.toml", "cure").arms["on"]
    left = sorted(set(declared) - {row['seed'] for row in cure})
    so_far, steps = " so far" if left else "", both(format(row['steps'], ',') for row in cure)
    assert f"{seeds_text([row['seed'] for row in cure])}{so_far}) it trained {steps} " \
           f"steps without a collapse where fix off collapsed at {collapses} on {on_seeds}, layer 0's max logit " \
           f"{both(f'{at(run, 10_000):.1f}' for run in on)} at step 10,000, at most {both(f'{peak(run):.1f}' for run in on)}" \
           in text
    assert f"On seed 1 layer 0 rose slowly, to {at(on[1], 150_000):.1f} by step 150,000, as it did on that seed with " \
           f"the shift and the fp32 O ({at('seed_study/runs/paper-fp32-o-s1', 10_000):.1f} at step 10,000, at most " \
           f"{peak('seed_study/runs/paper-fp32-o-s1'):.1f}) and in fp32 attention " \
           f"({at('seed_study/runs/attn-fp32-s1', 10_000):.1f}, at most {peak('seed_study/runs/attn-fp32-s1'):.1f})" \
           in text
    verb = "is" if len(left) == 1 else "are"
    assert f"{seeds_text(left)[:1].upper()}{seeds_text(left)[1:]} {verb} still to run" in text if left \
        else "still to run" not in text
    rows = read_table(root / "results/seed_study/runs.csv")
    arm = lambda name: [row for row in rows if row["arm"] == name]
    delta = arm("delta-fp32")
    assert not any(row["collapsed"] for row in delta)
    assert f"trained {' and '.join(format(row['steps'], ',') for row in delta)} steps on two seeds" in text
    forward = [row for row in read_table(root / "results/stochastic_rounding/runs.csv")
               if row["arm"] == "forward-delta-fp32"]
    assert not any(row["collapsed"] for row in forward)
    assert f"and {analyze.between([row['steps'] for row in forward], ',')} steps on three seeds with O " \
           "stochastically rounded in the forward" in text and len(forward) == 3
    both = arm("paper-fp32-o")
    assert not any(row["collapsed"] for row in both) and len(both) == 8
    assert f"it trained {analyze.between([row['steps'] for row in both], ',')} steps on eight seeds, layer 0 never " \
           "doubling its step-10,000 value" in text
    for run in (root / "results/seed_study/runs").glob("paper-fp32-o-s*"):
        s, v = load_run(run).series(analyze.LOGIT)
        assert v.max() < 2 * v[s == 10_000][0], run
    off = [onset_lines(root / "results/seed_study/onset.txt")[row["name"]] for row in rows if fix_off(row)]
    cure_ties = [float(r["tie_rate_L0"]) for run in (root / "results/cure/runs").glob("on-s*") for r in log_rows(run)
            if r.get("tie_rate_L0") and 5000 <= int(r["step"]) <= 30000]
    assert f"ties are {analyze.between([100 * rate for run in off for rate in run['ties']])}% of layer 0's rows " \
           f"with the fix off and {analyze.between([100 * rate for rate in cure_ties])}% with the fix on (steps " \
           "5,000-30,000)" in text
    rule = arm("paper")
    assert rule and all(row["collapsed"] and row["lr"] == 1e-3 for row in rule)
    assert f"The paper's rule alone (`--fix paper`) collapsed on every seed run at lr 1e-3 " \
           f"({seeds_text(sorted(row['seed'] for row in rule))})" in text
    (from_p,) = arm("delta-from-p")
    assert not from_p["collapsed"] and f"Delta from P did the same (seed {from_p['seed']}, {from_p['steps']:,} steps)" \
           in text
    # lr 3e-3 with an earlier kernel, one run each: the paper's rule ran on where the fix off collapsed
    early = {row["name"]: row for row in read_table(root / "results/default_search/gpu_runs.csv")}
    paper, off3 = early["lr3e-3-paper-s0-run4"], early["lr3e-3-off-s0-run4"]
    assert not paper["collapsed"] and off3["collapsed"] and paper["lr"] == off3["lr"] == 3e-3
    assert f"the paper's rule ran {paper['steps']:,} steps on seed {paper['seed']} without a collapse (its max logit " \
           f"{sci(paper['max_logit'], 1)}) where fix off collapsed at {off3['collapse_step']:,}" in text
    lse = sorted(arm("lse-fp64"), key=lambda row: row["seed"])
    assert len(lse) == 2 and all(row["collapsed"] for row in lse) and \
           f"(both seeds collapsed: seeds {lse[0]['seed']} and {lse[1]['seed']}, at {lse[0]['collapse_step']:,} and " \
           f"{lse[1]['collapse_step']:,})" in text


def test_findings_curvature_numbers_are_their_files():
    """Section 4 (the curvature hypothesis): the probe's interval and its sign before the runaway in every run
    (results/delta_probe/), the quadratic loss's measured over predicted (results/mechanism/report.md)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 4. ", "## 5. ")
    probe = json.loads((root / "results/delta_probe/runs/off-s0/config.json").read_text())
    assert f"The probe (layer 0, every {probe['diag_interval']:,} steps on training batches)" in text
    phase1 = [row for row in read_table(root / "results/delta_probe/probe_runs.csv")
              if row["probe_batches"] == "train" and row["phase"] == 1]
    before = [row for row in phase1 if row["term"] == "total"]
    high_lr = {f"results/lr_sweep/runs/{row['name']}" for row in read_table(root / "results/lr_sweep/runs.csv")
               if row["lr"] >= 1e-2}
    learnt = [row for row in before if row["run"] not in high_lr]
    assert learnt and all(row["mean"] > 0 for row in learnt)
    never = [row for row in before if row["run"] in high_lr]   # lr 1e-2: the loss never memorised the text
    low = [float(np.nanmin(load_run(root / row["run"]).series("train_loss")[1]))
           for row in never]
    assert len(never) == 2 and min(low) > 0.5
    assert "positive while layer 0's logits stay below twice their value at step 10,000 (in the runs where they ran " \
           "away: before they doubled) in every run it read but the two in fp32 attention at lr 1e-2 " \
           f"(where every layer passed 100 by step 1,000, their train loss at its lowest " \
           f"{listed([f'{x:.2f}' for x in low])}: t " \
           f"{listed([format(row['t'], '+.1f') for row in never])})" in text
    lin = {row["run"]: row["t"] for row in phase1 if row["term"] == "lin" and row["run"] not in high_lr}
    assert lin.keys() == {row["run"] for row in learnt} and min(lin, key=lin.get) == "results/cure/runs/on-s4"
    assert f"(the first-order term's t per run from {min(lin.values()):+.1f}, `--fix on` on seed 4, to " \
           f"{max(lin.values()):+.1f} over those {len(lin)} runs" in text
    # the runs probed on fixed validation batches: their total of either sign, within two standard errors
    validation = [row for row in read_table(root / "results/delta_probe/probe_runs.csv")
                  if row["probe_batches"] == "validation" and row["term"] == "total"]
    assert all(abs(row["t"]) < 2 for row in validation)
    assert {row["run"] for row in validation} == {"results/delta_probe/runs/off-s0",
                                                   "results/seed_study/runs/paper-fp32-o-s0"}
    assert "two runs probed on fixed validation batches instead, `delta_probe/runs/off-s0` and " \
           "`seed_study/runs/paper-fp32-o-s0`, read it of either sign within its noise" in text
    report = (root / "results/mechanism/report.md").read_text().split("### The curvature effect")[1].split("###")[0]
    ratios = [float(cells[-1]) for line in report.splitlines() if line.startswith("| ")
              for cells in [[c.strip() for c in line.strip("|").split("|")]] if re.fullmatch(r"[\d.]+", cells[-1])]
    assert len(ratios) >= 6
    assert f"On a quadratic loss with known H the effect is exact (to {100 * max(abs(r - 1) for r in ratios):.1f}%)" \
           in text


def test_findings_late_stage_numbers_are_their_files():
    """Section 5 (the exponent's form): torch's backends' last logits and their steps past 1e6, the shipped
    kernel's steps from 1e6 to each collapse (seed_study/late_stage.txt), and the fork's table (late_stage/)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 5. ", "## 6. ")
    late = late_lines(root / "results/seed_study/late_stage.txt")
    rows = read_table(root / "results/seed_study/runs.csv")
    torch_runs = [late[row["name"]] for row in rows if row["arm"] in ("sdpa", "sdpa-flash")]
    forks = {arm: load_run(root / "results/late_stage/runs" / arm) for arm in ("fma", "torch", "sdpa-flash")}
    fork = int(forks["torch"].config["forked_from"].split("@")[1])
    after = {arm: (lambda s, v: v[s > fork])(*run.series(analyze.LOGIT)) for arm, run in forks.items()}
    last = [run["last"] for run in torch_runs] + [after[arm][-1] for arm in ("torch", "sdpa-flash")]
    assert not any(run["collapsed"] for run in torch_runs)
    assert f"their runs ended at logits of {sci(min(last), 0)}-{sci(max(last), 0)} without a collapse" in text
    assert max(run["after_1e6"] or 0 for run in torch_runs) >= 20_000 and "some after tens of thousands of steps " \
           "above 1e6" in text
    cudnn, words = [row for row in rows if row["arm"] == "sdpa"], ["none", "one", "two", "three", "four"]
    below = [row for row in cudnn if late[row["name"]]["after_1e6"] is None]
    stopped = {round(row["steps"], -3) for row in below if row["steps"] < 100_000}
    assert len(stopped) == 1 and f"({words[len(below)]} of cuDNN's {words[len(cudnn)]} never passed 1e6, " \
           f"{words[sum(row['steps'] < 100_000 for row in below)]} of them stopped at {stopped.pop():,} steps)" in text
    shipped = [late[row["name"]]["after_1e6"] for row in rows if analyze.as_shipped(row) and row["collapsed"]]
    assert shipped and max(shipped) < 10_000
    assert "within a few thousand steps of 1e6 with the kernel as it ships" in text
    seed = forks["torch"].config["seed"]
    assert all(run.config["seed"] == seed and run.config["forked_from"] == forks["torch"].config["forked_from"]
               for run in forks.values())
    assert f"| arm | after the fork (step {fork:,}, seed {seed}) |" in text
    collapse = forks["fma"].summary["collapse_step"]
    assert f"| loss collapse {collapse - fork:,} steps later | to {sci(after['fma'].max())} |" in text
    for arm in ("torch", "sdpa-flash"):
        run = forks[arm]
        assert not run.summary["collapsed"]
        assert f"| none in {run.summary['steps'] - fork:,} steps | {sci(after[arm].min())}-{sci(after[arm].max())} |" \
               in text, arm


def test_findings_autocast_numbers_are_their_files():
    """Section 6 (the autocast precision mode): the fix-off collapses and when layer 0 passed 100
    (results/paper_precision/runs.csv, onset.txt), against the fa2 mode's (seed_study/onset.txt)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 6. ", "## 7. ")
    off = [row for row in read_table(root / "results/paper_precision/runs.csv") if row["arm"] == "paper-precision-off"]
    onset = onset_lines(root / "results/paper_precision/onset.txt")
    past = [run["past_100"] for name, run in onset.items() if name.startswith("paper-precision-off-s")]
    fa2 = [run["past_100"] for name, run in onset_lines(root / "results/seed_study/onset.txt").items()
           if re.match(r"off-(fma-)?s\d", name)]
    assert len(past) == len(off) and min(fa2) >= 20_000   # "tens of thousands"
    assert f"fix off collapsed on {sum(row['collapsed'] for row in off)} of {len(off)} seeds, layer 0 past 100 at " \
           f"steps {analyze.between(past, ',')} (fa2 mode: tens of thousands)" in text
    paper = {name: run for name, run in onset.items() if name.startswith("paper-precision-paper-s")}
    assert all(run["past_100"] < onset[name.replace("-paper-s", "-off-s")]["past_100"] for name, run in paper.items())
    assert f"the paper's rule took off sooner still (seeds {listed(sorted(n[-1] for n in paper))})" in text
    variants = {row["name"]: row for row in read_table(root / "results/paper_precision/rounding_variants.csv")}
    both = sorted((name for name in variants if name.startswith("paper-precision-acc32-delta-fp32-s")),
                  key=lambda name: variants[name]["seed"])
    alone = [onset[name.replace(part, "")]["past_100"] for name in both for part in ("acc32-", "-delta-fp32")]
    assert all(onset[name]["past_100"] is None for name in both)
    doubled = [(variants[name]["seed"], onset[name]["doubled"]) for name in both if onset[name]["doubled"]]
    assert len(doubled) == 1 and f"only taking both out of delta held layer 0 below 100 through the runs made (seeds " \
           f"{listed([str(variants[name]['seed']) for name in both])}, " \
           f"{listed([format(variants[name]['steps'], ',') for name in both])} steps, where either alone passed 100 " \
           f"by step {analyze.between(alone, ',')}; seed {doubled[0][0]}'s layer 0 had doubled by step " \
           f"{doubled[0][1]:,})" in text


def test_findings_amplifier_numbers_are_their_files():
    """Section 7 (the amplifier): the 3-bit fix-off runs (results/amplifier/gpu_runs.csv) and the bits law's fit
    (bits_law.txt)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 7. ", "## 8. ")
    # P at 3 bits with O read for delta: the fix off and the paper's rule (its tie-counting variants among them;
    # the shift of every tile, p3-paper-shift-all, is another rule)
    rows = read_table(root / "results/amplifier/gpu_runs.csv")
    off, paper = ([row for row in rows if row["arm"] == arm] for arm in ("p3-off", "p3-paper"))
    assert all(row["mantissa_bits"] == 3 and row["delta"] == "o" and row["precision"] == "fa2" for row in off + paper)
    survived = max(row["steps"] for row in off if not row["collapsed"])
    assert all(row["collapsed"] for row in off + paper if row["steps"] > survived)
    shift_all = [row for row in rows if row["arm"] == "p3-paper-shift-all"]
    assert shift_all and not any(row["collapsed"] for row in shift_all)
    assert f"every fix-off run past {survived:,} steps collapsed, and the paper's rule too (a variant that shifts " \
           f"every tile's row max did not, in {analyze.between([row['steps'] for row in shift_all], ',')} steps on " \
           f"{['', 'one', 'two', 'three'][len(shift_all)]} seeds" in text
    from_p = [row for row in rows if row["arm"] == "p3-delta-from-p"]
    assert from_p and not any(row["collapsed"] for row in from_p) and "delta from P prevents it" in text
    law = (root / "results/amplifier/bits_law.txt").read_text()
    bits = re.findall(r"^P at (\d) bits: collapsed", law, re.M)
    fit = re.search(r"fit through ([\d, ]+) bits: ([\d.]+)x later per bit; at (\d+) bits \(plain bf16\) ([\d,]+) steps",
                    law)
    assert fit[1].replace(", ", "/") == "/".join(bits) == "2/3/4"
    steps = int(fit[4].replace(",", ""))
    # the fit is seed 0's runs (bits_law.txt's steps); seed 1's fix-off runs at 2 and 3 bits beside them
    counts = {b: len(re.search(rf"^P at {b} bits: collapsed at ([\d, ]+) \(", law, re.M)[1].split(", ")) for b in bits}
    fitted = [row for row in rows if re.fullmatch(r"p[234]-off-s0(-run\d)?", row["name"]) and row["collapsed"]]
    assert len(fitted) == sum(counts.values()) and {row["seed"] for row in fitted} == {0}
    assert counts == {"2": 3, "3": 3, "4": 1} and "seed 0's runs, three at 2 and 3 bits and one at 4" in text
    seed1 = {b: [row["collapse_step"] for row in rows if re.fullmatch(rf"p{b}-off-s1(-run\d)?", row["name"])]
             for b in (2, 3)}
    assert all(row["collapsed"] for row in rows if re.fullmatch(r"p[23]-off-s1(-run\d)?", row["name"]))
    assert f"Collapse comes {fit[2]}x later per bit of P ({' / '.join(bits)} bits; seed 0's runs, three at 2 and 3 " \
           f"bits and one at 4; seed 1's collapsed at {analyze.between(seed1[2], ',')} and " \
           f"{analyze.between(seed1[3], ',')} steps), which extrapolated to bf16's {fit[3]} bits is " \
           f"~{round(steps, -3):,} steps" in text


def test_results_readme_names_every_h100_run():
    """results/README.md's opening names, study by study, the runs whose card was an H100: every runs.csv's `gpu`
    column."""
    root = Path(analyze.__file__).parent / "results"
    named = re.search(r"\(an H100: (.*?); a blank cell", " ".join((root / "README.md").read_text().split()))[1]
    h100 = {table.parent.name: [row for row in read_table(table) if "H100" in (row.get("gpu") or "")]
            for table in root.glob("*/runs.csv")}
    assert {study for study, rows in h100.items() if rows} == {"cure", "lr_sweep", "memorisation"}
    assert sorted(row["seed"] for row in h100["cure"]) == [0, 1, 3, 4, 5, 6, 7]
    assert named.startswith("the cure study's seeds 0, 1 and 3-7 and lr_sweep's ")
    sweep, memorisation = named.split("lr_sweep's ")[1].split("the memorisation study's ")
    for text, study in ((sweep, "lr_sweep"), (memorisation, "memorisation")):
        assert set(re.findall(r"`([\w-]+)`", text)) == {row["name"] for row in h100[study]}


def test_results_readme_says_where_and_how_long_each_new_run_ran():
    """The lr_sweep and memorisation studies' provenance names every run of their runs/ once, each as "`NAME` ran
    [alone] on one CARD at COMMIT, [what ran beside it,] to its N steps (M training minutes)" (or "to its collapse",
    or two runs "`A` and then `B` ... each to its ... (M and M training minutes)"): card, commit, steps or collapse and
    minutes to one decimal are that run's summary.json."""
    root = Path(analyze.__file__).parent / "results"
    said = []
    for study in ("lr_sweep", "memorisation"):
        text = doc_section("results/README.md", f"## {study}/", "<!-- all runs" if study == "memorisation" else "| file")
        said += re.findall(r"`([\w-]+)`(?: and (?:then )?`([\w-]+)`)?(?: \([^()]*\))? ran (?:side by side )?(?:alone )?"
                           r"on one (H100|H200) at ([0-9a-f]{7})[^;]*? (?:each )?to its (collapse|[\d,]+ steps)"
                           r"(?: at step ([\d,]+))? \(([\d.]+)(?: and ([\d.]+))? training minutes", text)
    folders = {folder.name: folder for study in ("lr_sweep", "memorisation")
               for folder in (root / study / "runs").iterdir()}
    named = [name for first, then, *_ in said for name in (first, then) if name]
    assert sorted(named) == sorted(folders)   # every run, each once
    for first, then, card, commit, end, at_step, *minutes in said:
        for name, spent in zip((first, then), minutes):
            if not name:
                continue
            summary = json.loads((folders[name] / "summary.json").read_text())
            assert card in summary["provenance"]["gpu"] and summary["provenance"]["commit"].startswith(commit), name
            assert end == ("collapse" if summary["collapsed"] else f"{summary['steps']:,} steps"), name
            assert not at_step or at_step == f"{summary['collapse_step']:,}", name
            assert spent == f"{summary['minutes']:.1f}", name


def test_findings_learning_rate_numbers_are_their_files():
    """Section 9 (the learning rate): each run of results/lr_sweep/ against its log (every layer's max logit, the
    train loss's minimum) and runs.csv, and the default lr's collapses (the seed study's `off-fma`)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 9. ", "## 10. ")
    rows = {row["name"]: row for row in read_table(root / "results/lr_sweep/runs.csv")}
    runs = {name: load_run(root / "results/lr_sweep/runs" / name) for name in rows}
    layers = lambda run: {int(c[len("max_logit_L"):]): run.series(c) for c in run.columns(r"max_logit_L\d+")}
    at = lambda series, step: float(series[1][series[0] == step][0])
    past = lambda series, level: int(series[0][np.argmax(series[1] > level)]) if (series[1] > level).any() else None
    others = lambda run: max(float(s[1].max()) for layer, s in layers(run).items() if layer)
    low = lambda run: float(np.nanmin(run.series("train_loss")[1]))
    off3, on3 = runs["off-lr3e-3-s0"], runs["on-lr3e-3-s0"]
    off3_l0, on3_l0 = layers(off3)[0], layers(on3)[0]
    default = [row["collapse_step"] for row in read_table(root / "results/seed_study/runs.csv")
               if row["arm"] == "off-fma"]
    assert f"past 100 by step {past(off3_l0, 100):,} (the first diagnostic after it), the other layers at most " \
           f"{others(off3):.0f}, and the loss collapsed at step {rows['off-lr3e-3-s0']['collapse_step']:,}, after " \
           f"the model had learnt its text (train loss at its minimum {low(off3):.2f}), against " \
           f"{min(default):,}-{max(default):,} steps at the default 1e-3" in text
    rope3, rope3_l0 = rows["rope-lr3e-3-s0"], layers(runs["rope-lr3e-3-s0"])[0]
    assert f"Rotary positions at 3e-3 (`--fix off --pos rope --lr 3e-3`) did not collapse in {rope3['steps']:,} " \
           f"steps, layer 0 at most {rope3_l0[1].max():.1f} (at step {int(rope3_l0[0][np.argmax(rope3_l0[1])]):,}) " \
           f"and {at(rope3_l0, 10_000):.1f} at step 10,000, after learning its text as far (train loss at its " \
           f"minimum {low(runs['rope-lr3e-3-s0']):.2f})" in text
    assert not rope3["collapsed"] and rope3["steps"] > rows["off-lr3e-3-s0"]["collapse_step"]
    early = {row["name"]: row for row in read_table(root / "results/default_search/gpu_runs.csv")}   # earlier kernel
    e0, e1, e2 = (early[name] for name in ("lr3e-3-off-s0-run4", "lr3e-3-off-s1-run2", "lr3e-3-off-s2-run2"))
    paper = early["lr3e-3-paper-s0-run4"]
    assert e0["collapsed"] and not e1["collapsed"] and not e2["collapsed"] and not paper["collapsed"]
    assert f"seed 0 collapsed at {e0['collapse_step']:,} and seeds 1 and 2 did not in {e1['steps']:,} and " \
           f"{e2['steps']:,} steps (their max logit {sci(e1['max_logit'])} and {sci(e2['max_logit'])})" in text
    assert f"| lr 3e-3: seed 0 collapses at {e0['collapse_step']:,} ({e0['collapse_minute']:.1f} minutes), seeds 1 " \
           f"and 2 not in {e1['steps']:,} / {e2['steps']:,} steps; the paper's rule {paper['steps']:,} steps without " \
           f"a collapse, max logit {sci(paper['max_logit'])} |" in " ".join((root / "results/README.md").read_text().split())
    slow = {arm: f"{arm}-lr3e-4-s0" for arm in ("off", "on", "fp32")}
    assert not any(rows[name]["collapsed"] for name in slow.values())
    assert {rows[name]["steps"] for name in slow.values()} == {40_000}
    default_at = at(layers(load_run(root / "results/seed_study/runs/off-fma-s0"))[0], 40_000)
    peak = {arm: layers(runs[name])[0][1].max() for arm, name in slow.items()}
    assert f"At 3e-4 no attention collapsed in 40,000 steps and layer 0 hardly grew, though the model learnt its text " \
           f"as far (train loss at its minimum {analyze.between([low(runs[name]) for name in slow.values()], '.2f')} in " \
           f"each): at most {peak['off']:.1f} with the fix off (at 1e-3 on seed 0 {default_at:.1f} by step " \
           f"40,000), {peak['on']:.1f} with the fix on and {peak['fp32']:.1f} with fp32 attention" in text
    high = [name for name in rows if "lr1e-2" in name]
    first = min(int(s[0][0]) for name in high for s in layers(runs[name]).values())
    assert all(past(s, 100) == first for name in high for s in layers(runs[name]).values()) and len(high) == 5
    collapsed = [name for name in high if rows[name]["collapsed"]]
    assert sorted(collapsed) == sorted(name for name in high if rows[name]["attn"] == "kernel")   # bf16's alone
    assert f"every layer's max logit passed 100 by step {first:,} in all three attentions and with rotary " \
           f"positions, in bf16 and in fp32 attention alike" in text
    fp32, rope = rows["fp32-lr1e-2-s0"], rows["rope-fp32-lr1e-2-s0"]
    assert f"(its minimum {analyze.between([low(runs[name]) for name in collapsed])}): the fix off at " \
           f"{rows['off-lr1e-2-s0']['collapse_step']:,} steps, the fix on at " \
           f"{rows['on-lr1e-2-s0']['collapse_step']:,}, rotary positions (`--fix off --pos rope --lr 1e-2`) " \
           f"soonest, at {rows['rope-lr1e-2-s0']['collapse_step']:,}. fp32 attention did not collapse: not in " \
           f"{fp32['steps']:,} steps with GPT-2's block, its logits at {sci(fp32['max_logit'])}, layer 0's at " \
           f"{sci(layers(runs['fp32-lr1e-2-s0'])[0][1].max())}, the train loss {fp32['final_train_loss']:.2f} at the " \
           f"end, nor in" in text
    assert f"with that error removed (`--fix on`) the run still collapsed, at " \
           f"{rows['on-lr1e-2-s0']['collapse_step']:,} steps (one seed)" in text
    assert rows["rope-lr1e-2-s0"]["collapse_step"] < min(rows[name]["collapse_step"] for name in collapsed
                                                         if name != "rope-lr1e-2-s0")   # soonest
    assert f"nor in {rope['steps']:,} with rotary positions (`--attn fp32 --pos rope --lr 1e-2`), its logits at " \
           f"{sci(rope['max_logit'])}, layer 0's at {sci(layers(runs['rope-fp32-lr1e-2-s0'])[0][1].max())}, the " \
           f"train loss {rope['final_train_loss']:.2f} at the end" in text
    assert not rows["on-lr3e-3-s0"]["collapsed"]
    off3_s1, off3_s1_l0 = rows["off-lr3e-3-s1"], layers(runs["off-lr3e-3-s1"])[0]
    assert f"With the kernel as it ships seed 1 (`off-lr3e-3-s1`) did not collapse in {off3_s1['steps']:,} steps " \
           f"either, though its layer 0 grew as seed 0's had, slower: past 100 at {past(off3_s1_l0, 100):,}, " \
           f"{off3_s1_l0[1][-1]:.0f} at the end, the other layers at most {others(runs['off-lr3e-3-s1']):.0f}, the " \
           f"train loss at its minimum {low(runs['off-lr3e-3-s1']):.2f}" in text
    assert not off3_s1["collapsed"] and past(off3_s1_l0, 100) > past(off3_l0, 100)
    off3_s2, off3_s2_l0 = rows["off-lr3e-3-s2"], layers(runs["off-lr3e-3-s2"])[0]
    assert f"Seed 2 (`off-lr3e-3-s2`) did not collapse in {off3_s2['steps']:,} steps either, its layer 0 further " \
           f"along: past 100 at {past(off3_s2_l0, 100):,}, {off3_s2_l0[1][-1]:,.0f} at the end, the other layers at " \
           f"most {others(runs['off-lr3e-3-s2']):.0f}, the train loss at its minimum " \
           f"{low(runs['off-lr3e-3-s2']):.2f}. So at 3e-3 layer 0 ran away on all three seeds, sooner than at 1e-3, " \
           f"and one of the three collapsed within 40,000 steps" in text
    assert not off3_s2["collapsed"] and off3_s2["steps"] == 40_000 and off3_s2_l0[1][-1] > off3_s1_l0[1][-1]
    seed_runs = [rows[f"off-lr3e-3-s{seed}"] for seed in range(3)]
    default_past = [past(layers(load_run(root / "results/seed_study/runs" / f"off-fma-s{seed}"))[0], 100)
                    for seed in range(4)]
    assert sum(row["collapsed"] for row in seed_runs) == 1 and max(past(layers(runs[row["name"]])[0], 100)
                                                                   for row in seed_runs) < min(default_past)
    assert "(seed 0; on seeds 1 and 2 the fix off did not collapse there either, though its layer 0 ran away)" in text
    claims = " ".join((root / "results/README.md").read_text().split())   # the claims table's row says the same
    assert f"(seed 0, and at 3e-3 seeds 1 and 2 of the fix off and on; the kernel as it ships): at 3e-3 fix off " \
           f"collapsed " \
           f"at {rows['off-lr3e-3-s0']['collapse_step']:,} (train loss at its minimum {low(off3):.2f}; seeds 1 and 2 " \
           f"not in {off3_s1['steps']:,} steps, layer 0 past 100 at {past(off3_s1_l0, 100):,} and " \
           f"{past(off3_s2_l0, 100):,}, {off3_s1_l0[1][-1]:.0f} and {off3_s2_l0[1][-1]:,.0f} at the end)" in claims
    seeds = sorted({row["seed"] for row in rows.values()})
    assert "## 9. The learning rate (the sweep: one seed each; at 3e-3 three with the fix off and three with the fix " \
           "on)" in (root / "docs/findings.md").read_text() and seeds == [0, 1, 2]
    assert {name for name, row in rows.items() if row["seed"]} == {f"{arm}-lr3e-3-s{seed}" for arm in ("off", "on")
                                                                     for seed in (1, 2)}
    # the fix on at 3e-3 on seeds 0-2: none collapsed; its layer 0 past 100 later than the fix off's, or never
    fix = {seed: (rows[f"on-lr3e-3-s{seed}"], layers(runs[f"on-lr3e-3-s{seed}"])[0]) for seed in range(3)}
    off_past = [past(layers(runs[f"off-lr3e-3-s{seed}"])[0], 100) for seed in range(3)]
    assert not any(row["collapsed"] for row, _ in fix.values()) and fix[2][1][1].max() < 100
    assert all(past(fix[seed][1], 100) > off_past[seed] for seed in (0, 1))
    assert f"At 3e-3 the fix on collapsed on none of three seeds in {fix[0][0]['steps']:,} steps, the fix off on one " \
           f"(seed 0;" in text and f"and on each seed the fix's layer 0 grew slower: past 100 at " \
           f"{past(fix[0][1], 100):,} and {past(fix[1][1], 100):,} on seeds 0 and 1 and not at all on seed 2, where " \
           f"the fix off's passed 100 at {min(off_past):,}-{max(off_past):,} on all three" in text
    s1_l0, s2_l0 = layers(runs["off-lr3e-3-s1"])[0], layers(runs["off-lr3e-3-s2"])[0]
    assert f"On seeds 1 and 2 (`on-lr3e-3-s1`, `on-lr3e-3-s2`) the fix on did not collapse in " \
           f"{fix[1][0]['steps']:,} steps either, and its layer 0 stayed behind the fix off's of the same seed: on " \
           f"seed 1 past 100 at {past(fix[1][1], 100):,} (fix off: {off_past[1]:,}), {fix[1][1][1][-1]:.0f} at the " \
           f"end (fix off: {s1_l0[1][-1]:.0f}); on seed 2 at most {fix[2][1][1].max():.1f}, never past 100 (fix off: " \
           f"past 100 at {off_past[2]:,}, {s2_l0[1][-1]:,.0f} at the end); the other layers at most " \
           f"{others(runs['on-lr3e-3-s1']):.1f} and {others(runs['on-lr3e-3-s2']):.1f}, the train loss at its " \
           f"minimum {analyze.between([low(runs[f'on-lr3e-3-s{seed}']) for seed in (1, 2)], '.2f')} in each" in text
    assert fix[2][0]["steps"] == fix[1][0]["steps"] and fix[1][1][1][-1] < s1_l0[1][-1]
    assert f"fix on not in {fix[0][0]['steps']:,} steps on any of seeds 0-2 (layer 0 past 100 at " \
           f"{past(fix[0][1], 100):,} and {past(fix[1][1], 100):,} on seeds 0 and 1, {fix[0][1][1][-1]:.0f} and " \
           f"{fix[1][1][1][-1]:.0f} at the end; on seed 2 at most {fix[2][1][1].max():.1f})" in claims
    assert f"At 3e-3 the fix on did not collapse in {rows['on-lr3e-3-s0']['steps']:,} steps (fix off: " \
           f"{rows['off-lr3e-3-s0']['collapse_step']:,}), yet layer 0 alone still grew, slower: " \
           f"{at(on3_l0, 4_000):.1f} at step 4,000 (fix off: {at(off3_l0, 4_000):.0f}), past 100 at " \
           f"{past(on3_l0, 100):,}, {on3_l0[1][-1]:.0f} at the end, the other layers at most {others(on3):.1f}" in text
    fp32_3, fp32_l0 = rows["fp32-lr3e-3-s0"], layers(runs["fp32-lr3e-3-s0"])[0]
    assert f"fp32 attention at 3e-3 did not grow so: layer 0 at {at(fp32_l0, 1_000):.1f} by step 1,000, " \
           f"{at(fp32_l0, 10_000):.1f} at step 10,000, at most {fp32_l0[1].max():.1f}, {fp32_l0[1][-1]:.1f} at the " \
           f"end, no collapse in {fp32_3['steps']:,} steps" in text and not fp32_3["collapsed"]
    assert fp32_l0[1].max() < 100 < on3_l0[1][-1]
    shift3 = runs["paper-fp32-o-lr3e-3-s0"]
    shift3_l0 = layers(shift3)[0]
    assert f"(`--fix paper --delta fp32-o --lr 3e-3`) layer 0 was at {at(shift3_l0, 4_000):.1f} at step 4,000, past " \
           f"100 at {past(shift3_l0, 100):,}, {shift3_l0[1][-1]:.0f} at the end, the other layers at most " \
           f"{others(shift3):.1f}, no collapse in {rows['paper-fp32-o-lr3e-3-s0']['steps']:,} steps" in text
    assert not rows["paper-fp32-o-lr3e-3-s0"]["collapsed"] and shift3_l0[1][-1] > 100
    assert f"{peak['on']:.1f}" == f"{peak['fp32']:.1f}"   # the claims row gives one number for both
    assert f"fp32 attention not in {fp32_3['steps']:,} (layer 0 at most {fp32_l0[1].max():.1f}), rotary positions " \
           f"not in {rope3['steps']:,} (layer 0 at most {rope3_l0[1].max():.1f}); at 3e-4 none in 40,000 (layer 0 at " \
           f"most {peak['off']:.1f} with fix off, {peak['on']:.1f} with fix on and with fp32 attention; train loss at " \
           f"its minimum {analyze.between([low(runs[name]) for name in slow.values()], '.2f')}); at 1e-2 every layer " \
           f"of every run past 100 by step {first:,}; fix off collapsed at {rows['off-lr1e-2-s0']['collapse_step']:,}, " \
           f"fix on at {rows['on-lr1e-2-s0']['collapse_step']:,}, rotary positions at " \
           f"{rows['rope-lr1e-2-s0']['collapse_step']:,} (train loss at its lowest " \
           f"{analyze.between([low(runs[name]) for name in collapsed])}), fp32 attention not in {fp32['steps']:,} " \
           f"steps (max logit {sci(fp32['max_logit'], 2)}, layer 0's {sci(layers(runs['fp32-lr1e-2-s0'])[0][1].max(), 2)}, " \
           f"train loss {fp32['final_train_loss']:.2f} at the end), nor with rotary positions in {rope['steps']:,} " \
           f"(max logit {sci(rope['max_logit'], 2)}, layer 0's {sci(layers(runs['rope-fp32-lr1e-2-s0'])[0][1].max(), 2)}, " \
           f"train loss {rope['final_train_loss']:.2f} at the end)" in claims


def test_findings_open_speed_numbers_are_their_file():
    """Section 11's speed: the fix with the shift against cuDNN and torch's flash backend (results/speed/bench.csv),
    as kernel.md gives them; the fix as it ships against cuDNN, and its cost below seq 4k (fix_cost.csv)."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 11. ", "## 12. ")
    _, cudnn, flash = bench_ratios(root / "results/speed/bench.csv")
    assert f"forward+backward at {cudnn} cuDNN at seq 4k-16k on the H200 (`results/speed/bench.csv`; {flash} " \
           "torch's flash backend at every length timed)" in text
    rows = [row for row in read_table(root / "results/speed/fix_cost.csv") if row["impl"] == "ours_fix"]
    to_cudnn = {shape: np.median([r["fwd_bwd_vs_cudnn"] for r in rows if (r["head_dim"], r["seq"]) == shape])
                for shape in {(r["head_dim"], r["seq"]) for r in rows if r["seq"] >= 4096}}
    (D, N), best = max(to_cudnn.items(), key=lambda item: item[1])
    assert [shape for shape, ratio in to_cudnn.items() if round(ratio, 2) >= 0.80] == [(D, N)]   # that shape alone
    assert f"0.8x at every shape from seq 4k on is not reached ({best:.2f} at head_dim {D}, seq {N // 1024}k alone)" \
           in text
    to_cudnn = list(to_cudnn.values())
    short, _ = fix_cost(root)
    one_round = [row["fwd_bwd_vs_cudnn"] for row in read_table(root / "results/speed/bench_h100.csv")
                 if row["impl"] == "ours_fix" and row["seq"] >= 4096]
    assert f"as it ships, at {analyze.between(to_cudnn, '.2f')}x on an H100 (`results/speed/fix_cost.csv`, the " \
           f"median of five rounds; README's table, one round of `bench_h100.csv`: " \
           f"{analyze.between(one_round, '.2f')}x), its fp32 O's store costing {min(short):+.1f}% to {max(short):+.1f}% below seq 4k" in text


def test_findings_memorisation_numbers_are_the_logs():
    """Section 10: TinyShakespeare's collapses at lr 1e-3 and 3e-3 whose logs are kept (in every study) came after the
    text was memorised; the corpus runs' collapses, losses and runaway layers against their logs."""
    root = Path(analyze.__file__).parent
    text = doc_section("docs/findings.md", "## 10. ", "## 11. ")
    kept, corpus = {}, read_table(root / "results/memorisation/runs.csv")   # study/arm: its collapsed runs' folders
    for table in (root / "results").glob("*/runs.csv"):
        for row in read_table(table):
            on_shakespeare = "--preset corpus" not in (row["flags"] or "")
            if row["collapsed"] and row["log_kept"] and row["lr"] <= 3e-3 and on_shakespeare:
                kept.setdefault(f"{table.parent.name}/{row['arm']}", []).append(table.parent / "runs" / row["name"])
    assert sorted(kept) == ["late_stage/fma", "lr_sweep/off-lr3e-3", "seed_study/off", "seed_study/off-fma",
                            "seed_study/paper", "stochastic_rounding/forward"]
    shakespeare = [load_run(run) for runs in kept.values() for run in runs]
    lowest_val = [run.series("val_loss") for run in shakespeare]
    assert {int(steps[np.argmin(val)]) for steps, val in lowest_val} == {1000}
    peaks = lambda run: [run.series(c)[1].max() for c in run.columns(r"max_logit_L\d+")]
    assert all(np.argmax(peaks(run)) == 0 for run in shakespeare)
    low = [float(np.nanmin(run.series("train_loss")[1])) for run in shakespeare]
    assert f"whose log is kept ({len(low)} runs:" in text and f"layer 0 ran away in each of those {len(low)} collapses" in text
    assert f"the train loss had first fallen to {analyze.between(low, '.3f')}, and the val loss was lowest at the " \
           f"first evaluation ({analyze.between([val.min() for _, val in lowest_val], '.2f')} at step 1,000)" in text
    default = [row["collapse_step"] for row in read_table(root / "results/seed_study/runs.csv")
               if row["arm"] == "off-fma"]
    off = sorted((row for row in corpus if row["arm"] == "off"), key=lambda row: row["seed"])
    assert [row["seed"] for row in off] == [0, 1, 2] and all(row["collapsed"] for row in off)
    steps = [row["collapse_step"] for row in off]
    runs = [load_run(root / "results/memorisation/runs" / row["name"]) for row in off]
    lowest = [(int(s[np.argmin(v)]), float(v.min())) for s, v in (run.series("val_loss") for run in runs)]
    assert f"fix off collapsed on all three seeds run, at steps {steps[0]:,}, {steps[1]:,} and {steps[2]:,} (seeds " \
           f"0, 1 and 2), within the range of TinyShakespeare's {min(default):,}-{max(default):,}; the val loss had " \
           f"been at its lowest {steps[0] - lowest[0][0]:,}, {steps[1] - lowest[1][0]:,} and " \
           f"{steps[2] - lowest[2][0]:,} steps before" in text
    assert min(default) < min(steps) and max(steps) < max(default)
    train_chars = 97_195_904   # data/README.md's split of the corpus
    assert f"first {train_chars:,} characters" in " ".join((root / "data/README.md").read_text().split())
    passes = [f"{row['collapse_step'] * row['batch_size'] * row['block_size'] / train_chars:.1f}" for row in off]
    assert f"on {train_chars:,} characters, which the three runs had read {passes[0]}, {passes[1]} and {passes[2]} " \
           "times each by their collapse" in text
    on = next((row for row in corpus if row["name"] == "on-s0"), None)   # the fix on, seed 0
    assert on is not None and not on["collapsed"] and on["steps"] >= 1.5 * steps[0]
    on_run = load_run(root / "results/memorisation/runs/on-s0")
    floor = lambda runs: np.floor(min(np.nanmin(run.series("train_loss")[1]) for run in runs) * 100) / 100
    on_runs = [load_run(root / "results/memorisation/runs" / f"on-s{seed}") for seed in (0, 1, 2)]
    assert f"The fix off's train loss never fell below {floor(runs):.2f} (the fix on's, over their longer runs, " \
           f"{floor(on_runs):.2f})." in text
    layer = lambda run, i: run.series(f"max_logit_L{i}")
    at = lambda series, step: float(series[1][series[0] == step][0])
    past = lambda series: int(series[0][np.argmax(series[1] > 100)]) if (series[1] > 100).any() else None
    s0, s1, s2 = runs
    assert f"In seed 1 the val loss rose from its lowest, {lowest[1][1]:.3f} at step {lowest[1][0]:,}, to " \
           f"{at(s1.series('val_loss'), 62_000):.2f} by step 62,000 as layer 0's max logit ran away: past 100 at " \
           f"step {past(layer(s1, 0)):,}, {sci(layer(s1, 0)[1].max())} at the collapse" in text
    assert f"Seed 2 likewise: the val loss rose from its lowest, {lowest[2][1]:.3f} at step {lowest[2][0]:,}, to " \
           f"{at(s2.series('val_loss'), 85_000):.2f} by step 85,000 as layer 0's ran away, past 100 at step " \
           f"{past(layer(s2, 0)):,}, {sci(layer(s2, 0)[1].max())} at the collapse; its layers 1 and 2 passed 100 " \
           f"(layer 1 early, at step {past(layer(s2, 1)):,}) and did not run away (at most " \
           f"{layer(s2, 1)[1].max():.0f} and {layer(s2, 2)[1].max():.0f})" in text
    assert [i for i in range(1, 6) if layer(s2, i)[1].max() > 100] == [1, 2]
    assert np.argmax(peaks(s2)) == 0 and max(peaks(s2)[1:]) < 1_000 < layer(s2, 0)[1].max()
    assert f"layer 1 at {at(layer(s0, 1), 10_000):.1f} at step 10,000, past 100 at {past(layer(s0, 1)):,}, " \
           f"{sci(layer(s0, 1)[1].max())} at the collapse, while layer 0's peaked at {layer(s0, 0)[1].max():.0f}" \
           in text and np.argmax(peaks(s0)) == 1 and np.argmax(peaks(s1)) == 0
    assert "In seeds 1 and 2 the logits ran away in layer 0, as on TinyShakespeare; in seed 0 in layer 1." in text
    # the fix on, seed 0: no collapse in 1.5x its fix off's steps, layer 1 slowed below 100 where the fix off's ran away
    fixed = {row["seed"]: row for row in corpus if row["arm"] == "on"}   # the fix on, each seed to 1.5x its collapse
    assert sorted(fixed) == [0, 1, 2] and not any(row["collapsed"] for row in fixed.values())
    assert all(row["steps"] >= 1.5 * steps[seed] for seed, row in fixed.items())
    runaway = [(1, on_runs[0], s0), (0, on_runs[1], s1), (0, on_runs[2], s2)]   # (the fix off's runaway layer, runs)
    assert [np.argmax(peaks(off_run)) for _, _, off_run in runaway] == [1, 0, 0]
    assert all(layer(on_run, i)[1].max() < 100 for i, on_run, _ in runaway)
    shown = [f"{layer(on_run, i)[1].max():.1f}, the fix off's {sci(layer(off_run, i)[1].max(), 1)}"
             for i, on_run, off_run in runaway]
    assert f"With the fix on, none of the three collapsed in {fixed[0]['steps']:,}, {fixed[1]['steps']:,} and " \
           f"{fixed[2]['steps']:,} steps, 1.5x their fix off's collapses, and the layer whose logits ran away with the " \
           f"fix off stayed below 100 with it (seed 0's layer 1 at most {shown[0]}; seed 1's layer 0 at most " \
           f"{shown[1]}; seed 2's layer 0 at most {shown[2]})" in text
    on_l1, off_l1, val = layer(on_run, 1), layer(s0, 1), on_run.series("val_loss")
    end = val[1][val[0] >= val[0][-1] - 20_000]   # its last 20,000 steps
    assert f"layer 1 grew, slower, and stayed below 100: {at(on_l1, 60_000):.1f} at step 60,000 and " \
           f"{at(on_l1, 65_000):.1f} at 65,000 (the fix off's {at(off_l1, 60_000):.0f} and " \
           f"{at(off_l1, 65_000):.0f}), " \
           f"{on_l1[1][-1]:.1f} at the end, at most {on_l1[1].max():.1f}; layer 0 at most " \
           f"{layer(on_run, 0)[1].max():.1f}. The val loss matched the fix off's ({at(val, lowest[0][0]):.3f} and " \
           f"{lowest[0][1]:.3f} at step {lowest[0][0]:,}, the fix off's lowest) and was level at {end.min():.3f}-" \
           f"{end.max():.3f} over its last 20,000 steps" in text
    assert on_l1[1].max() < 100 < at(off_l1, 60_000) and abs(at(val, lowest[0][0]) - lowest[0][1]) < 0.005
    # the fix on, seed 1: layer 0, the fix off's runaway, stayed flat; layer 1 passed 100 and did not run away
    on1, on2 = on_runs[1:]
    on1_l1, val1 = layer(on1, 1), on1.series("val_loss")
    best = lambda val: (int(val[0][np.argmin(val[1])]), float(val[1].min()))   # a val loss's lowest: (step, loss)
    best1 = best(val1)
    assert f"On seed 1 (`on-s1`), where the fix off's layer 0 ran away, the fix on's stayed at most " \
           f"{layer(on1, 0)[1].max():.1f} (the fix off's passed 100 at step {past(layer(s1, 0)):,}); its layer 1 " \
           f"was not slowed: past 100 at step {past(on1_l1):,} (the fix off's at {past(layer(s1, 1)):,}), at most " \
           f"{on1_l1[1].max():.1f} (step {int(on1_l1[0][np.argmax(on1_l1[1])]):,}; the fix off's " \
           f"{at(layer(s1, 1), int(on1_l1[0][np.argmax(on1_l1[1])])):.0f} there, at most {layer(s1, 1)[1].max():.0f}), " \
           f"{on1_l1[1][-1]:.1f} at the end, no runaway. Its val loss did not rise: {at(val1, lowest[1][0]):.3f} at step " \
           f"{lowest[1][0]:,} (the fix off's lowest, {lowest[1][1]:.3f}) and {at(val1, 62_000):.3f} at 62,000 (the " \
           f"fix off's {at(s1.series('val_loss'), 62_000):.2f}), at its lowest {best1[1]:.3f} at step " \
           f"{best1[0]:,}" in text
    assert layer(on1, 0)[1].max() < 100 and max(layer(on1, i)[1].max() for i in range(6)) < 1_000
    # the fix on, seed 2: layer 0, the fix off's runaway, stayed flat; layer 1, past 100 early with the fix off, below
    on2_l1, val2 = layer(on2, 1), on2.series("val_loss")
    best2 = best(val2)
    assert f"On seed 2 (`on-s2`) the fix on's layer 0 stayed at most {layer(on2, 0)[1].max():.1f} (the fix off's " \
           f"passed 100 at step {past(layer(s2, 0)):,}), and its layer 1, past 100 at step {past(layer(s2, 1)):,} " \
           f"with the fix off and at most {layer(s2, 1)[1].max():.0f}, stayed below 100: at most " \
           f"{on2_l1[1].max():.1f} (step {int(on2_l1[0][np.argmax(on2_l1[1])]):,}), {on2_l1[1][-1]:.1f} at the end; " \
           f"layer 2 at most {layer(on2, 2)[1].max():.1f} (the fix off's {layer(s2, 2)[1].max():.0f}). Its val loss " \
           f"did not rise: {at(val2, lowest[2][0]):.3f} at step {lowest[2][0]:,} (the fix off's lowest, " \
           f"{lowest[2][1]:.3f}) and {at(val2, 85_000):.3f} at 85,000 (the fix off's " \
           f"{at(s2.series('val_loss'), 85_000):.2f}), at its lowest {best2[1]:.3f} at step {best2[0]:,}." in text
    assert on2_l1[1].max() < 100 < layer(s2, 1)[1].max() and max(layer(on2, i)[1].max() for i in range(6)) < 100
    # the control, fp32 attention on seed 0: no collapse where the fix off collapsed; its layer 1 the slowest of three
    control_row = next(row for row in corpus if row["name"] == "attn-fp32-s0")
    control = load_run(root / "results/memorisation/runs/attn-fp32-s0")
    c_l1, c_val, seed0 = layer(control, 1), control.series("val_loss"), (s0, on_run, control)
    assert not control_row["collapsed"] and control_row["steps"] >= 1.5 * steps[0]
    assert all(past(layer(run, 2)) <= 3_000 and layer(run, 2)[1].max() < 1_000 for run in seed0)
    rope_row = next(row for row in corpus if row["arm"] == "rope")   # rotary positions, the fix off, seed 0
    rope = load_run(root / "results/memorisation/runs" / rope_row["name"])
    rope_peak = max(peaks(rope))
    assert c_l1[1].max() < on_l1[1].max() < 100 and f"fp32 attention on seed 0, the control, did not collapse in " \
        f"{control_row['steps']:,} steps either, its layer 1 at most {c_l1[1].max():.1f}, nor did rotary positions " \
        f"on seed 0 (the fix off), no layer's max logit above {rope_peak:.1f}.**" in text
    assert f"did not collapse in {control_row['steps']:,} steps. Its layer 1, at {at(c_l1, 10_000):.1f} at step " \
           f"10,000 as in both bf16 arms (the fix off's {at(off_l1, 10_000):.1f}, the fix on's " \
           f"{at(on_l1, 10_000):.1f}), stayed below 100: {at(c_l1, 60_000):.1f} at step 60,000 and " \
           f"{at(c_l1, 65_000):.1f} at 65,000 (the fix off's {at(off_l1, 60_000):.0f} and {at(off_l1, 65_000):.0f}, " \
           f"the fix on's {at(on_l1, 60_000):.1f} and {at(on_l1, 65_000):.1f}), at most {c_l1[1].max():.1f} (step " \
           f"{int(c_l1[0][np.argmax(c_l1[1])]):,}); layer 0 at most {layer(control, 0)[1].max():.1f}. Layer 2 passed " \
           f"100 by step 3,000 in all three arms of seed 0 and ran away in none (at most " \
           f"{layer(control, 2)[1].max():.0f}; the fix off's {layer(s0, 2)[1].max():.0f}, the fix on's " \
           f"{layer(on_run, 2)[1].max():.0f}). Its val loss was {at(c_val, lowest[0][0]):.3f} at step " \
           f"{lowest[0][0]:,} (the fix off's lowest, {lowest[0][1]:.3f}), at its lowest {best(c_val)[1]:.3f} at step " \
           f"{best(c_val)[0]:,} (the fix on's {best(val)[1]:.3f} at {best(val)[0]:,})" in text
    ours = {f"results/memorisation/runs/{row['name']}" for row in off}
    probe = {(row["run"].split("/")[-1], row["term"]): row
             for row in read_table(root / "results/delta_probe/probe_runs.csv")
             if row["probe_batches"] == "train" and row["phase"] == 1 and row["run"] in ours}
    ours_names = [row["name"] for row in off]
    term = lambda name, what, spec: format(probe[name, what]["mean" if spec == ".1e" else "t"], spec)
    assert f"was positive (t {term('off-s0', 'total', '+.1f')} in seed 0, {term('off-s1', 'total', '+.1f')} in seed " \
           f"1, {term('off-s2', 'total', '+.1f')} in seed 2), the curvature term's size within its noise " \
           f"({term('off-s0', 'total', '.1e')} against {term('off-s0', 'curv', '.1e')}; " \
           f"{term('off-s1', 'total', '.1e')} against {term('off-s1', 'curv', '.1e')}; " \
           f"{term('off-s2', 'total', '.1e')} against {term('off-s2', 'curv', '.1e')}), and the part not correlated " \
           f"with the rounding at zero (t {term('off-s0', 'lin', '+.1f')}, {term('off-s1', 'lin', '+.1f')}, " \
           f"{term('off-s2', 'lin', '+.1f')}). So the one-signed error is there too on a text the model does not " \
           f"memorise (three runs)" in text
    probed = lambda name: [row for row in read_table(root / "results/delta_probe/probe_runs.csv")
                           if row["run"] == f"results/memorisation/runs/{name}" and row["probe_batches"] == "train"]
    fixed, fixed1, fixed2 = ({row["term"]: row for row in probed(name)} for name in ("on-s0", "on-s1", "on-s2"))
    fixed1_row, fixed2_row = (next(row for row in corpus if row["name"] == name) for name in ("on-s1", "on-s2"))
    # one phase, the whole run (layer 0 never doubled), positive in each
    assert all({row["phase"] for row in probed(name)} == {1} for name in ("on-s0", "on-s1", "on-s2"))
    assert fixed["total"]["last_step"] == on["steps"] and fixed1["total"]["last_step"] == fixed1_row["steps"] and \
        fixed2["total"]["last_step"] == fixed2_row["steps"]
    assert fixed["total"]["t"] > 2 and fixed1["total"]["t"] > 2 and fixed2["total"]["t"] > 2
    assert f"the probe reads it positive over the whole run, in `on-s0` (t {fixed['total']['t']:+.1f}; " \
           f"{fixed['total']['mean']:.1e} against the curvature term's {fixed['curv']['mean']:.1e}), in `on-s1` " \
           f"(t {fixed1['total']['t']:+.1f}; {fixed1['total']['mean']:.1e} against " \
           f"{fixed1['curv']['mean']:.1e}) and in `on-s2` (t {fixed2['total']['t']:+.1f}; " \
           f"{fixed2['total']['mean']:.1e} against {fixed2['curv']['mean']:.1e})" in text
    control_probe = {row["term"]: row for row in probed("attn-fp32-s0")}
    assert {row["phase"] for row in probed("attn-fp32-s0")} == {1} and control_probe["total"]["t"] > 2 \
        and control_probe["total"]["last_step"] == control_row["steps"]
    assert f"its probe reads the same error positive over the whole run (`attn-fp32-s0`, t " \
           f"{control_probe['total']['t']:+.1f}; {control_probe['total']['mean']:.1e} against " \
           f"{control_probe['curv']['mean']:.1e}), and nothing reads it" in text
    # rotary positions on seed 0: no collapse where GPT-2's block collapsed, no layer's logits far from their start;
    # on TinyShakespeare (the modern block's runs) layer 0 as flat
    assert rope_row["seed"] == 0 and rope_row["flags"] == "--preset corpus --fix off --pos rope" and \
        not rope_row["collapsed"] and rope_row["steps"] == control_row["steps"] == on["steps"] and rope_peak < 100
    top = int(np.argmax(peaks(rope)))
    r_top, r_val = layer(rope, top), rope.series("val_loss")
    shakespeare_rope = [row for row in read_table(root / "results/modern_block/runs.csv") if row["arm"] == "rope"]
    flat = analyze.between([row["max_logit"] for row in shakespeare_rope], ".1f")   # every layer's, every step
    assert sorted(row["seed"] for row in shakespeare_rope) == [0, 1, 2] and \
        all(row["steps"] == 200_000 and not row["collapsed"] for row in shakespeare_rope)
    pooled = {(row["arm"], row["term"]): row["mean"] for row in read_table(root / "results/delta_probe/probe_phases.csv")
              if row["probe_batches"] == "train" and row["phase"] == 1}   # section 8's ratio on TinyShakespeare
    there = pooled["--fix off", "total"] / pooled["--fix off --pos rope", "total"]
    rope_probe = {row["term"]: row for row in probed(rope_row["name"])}
    assert {row["phase"] for row in probed(rope_row["name"])} == {1} and rope_probe["total"]["t"] > 2 and \
        rope_probe["total"]["last_step"] == rope_row["steps"]
    gpt2 = [probe["off-s0", "total"], fixed["total"], control_probe["total"]]   # GPT-2's block on seed 0
    curv_ratio = [row["mean"] / rope_probe["curv"]["mean"]
                  for row in (probe["off-s0", "curv"], fixed["curv"], control_probe["curv"])]
    assert all(rope_probe["total"]["mean"] < row["mean"] < there * rope_probe["total"]["mean"] for row in gpt2) \
        and min(curv_ratio) > 1
    assert f"Rotary positions on seed 0 (`rope-s0`: `--pos rope`, the fix off; the batches of `off-s0`, other " \
           f"initial weights, its block having no position table) did not collapse in {rope_row['steps']:,} steps, " \
           f"and no layer's logits grew far: every layer's max logit stayed at most {rope_peak:.1f} (layer {top}, at " \
           f"step {int(r_top[0][np.argmax(r_top[1])]):,}). Layer 1, where GPT-2's block ran away on this seed, was at " \
           f"{at(layer(rope, 1), 10_000):.1f} at step 10,000 (GPT-2's block's {at(off_l1, 10_000):.1f}), at most " \
           f"{layer(rope, 1)[1].max():.1f}; layer 2, past 100 by step 3,000 in GPT-2's block's three arms, at most " \
           f"{layer(rope, 2)[1].max():.1f}; layer 0 at most {layer(rope, 0)[1].max():.1f}. On TinyShakespeare too " \
           f"rotary positions kept every layer's max logit at most {flat} over 200,000 steps (section 8's runs, seeds 0-2): " \
           f"on this seed of the larger text as there, their flat logits came with the block, not with a memorised " \
           f"text. Its val loss was {at(r_val, lowest[0][0]):.3f} at step " \
           f"{lowest[0][0]:,} (`off-s0`'s lowest, {lowest[0][1]:.3f}), at its lowest {best(r_val)[1]:.3f} at " \
           f"step {best(r_val)[0]:,}. The probe reads the error O's cast would put into delta positive over the " \
           f"whole run (t {rope_probe['total']['t']:+.1f}) and smaller than GPT-2's block's on this seed, though by " \
           f"less than on TinyShakespeare ({there:.0f}x, section 8): {rope_probe['total']['mean']:.1e} against {gpt2[0]['mean']:.1e} with the fix off up to " \
           f"its collapse, {gpt2[1]['mean']:.1e} with the fix on and {gpt2[2]['mean']:.1e} in fp32 attention over " \
           f"{control_row['steps']:,} steps, its curvature term {analyze.between(curv_ratio, '.1f')}x smaller " \
           f"({rope_probe['curv']['mean']:.1e})." in text
    claims = " ".join((root / "results/README.md").read_text().split())   # the claims table's row says the same
    three = lambda values: f"{values[0]}, {values[1]} and {values[2]}"
    floors = [f"{np.nanmin(run.series('train_loss')[1]):.3f}" for run in runs]
    totals = [f"{probe[name, 'total']['mean']:+.1e} (t {probe[name, 'total']['t']:+.1f})" for name in ours_names]
    curvs = [f"{probe[name, 'curv']['mean']:+.1e}" for name in ours_names]
    lins = [f"{probe[name, 'lin']['t']:+.1f}" for name in ours_names]
    assert f"(fix off, the `corpus` preset, seeds 0-2): collapsed at {three([f'{n:,}' for n in steps])} steps, " \
           f"train loss at its lowest {three(floors)}, val loss at its lowest " \
           f"{three([f'{v:.3f} (step {s:,})' for s, v in lowest])};" in claims
    assert f"total {three(totals)} against curv {three(curvs)}, lin t {three(lins)}" in claims
    assert f"With the fix on, seed 0 (`on-s0`): no collapse in {on['steps']:,} steps, layer 1 at most " \
           f"{on_l1[1].max():.1f} (the fix off's {at(off_l1, 60_000):.0f} at step 60,000, " \
           f"{at(off_l1, 65_000):.0f} at 65,000), layer 0 at most {layer(on_run, 0)[1].max():.1f}, val loss {at(val, lowest[0][0]):.3f} at step " \
           f"{lowest[0][0]:,} (the fix off's {lowest[0][1]:.3f}), {end.min():.3f}-{end.max():.3f} over its last " \
           f"20,000 steps; its probe of layer 0 over the whole run total {fixed['total']['mean']:+.1e} " \
           f"(t {fixed['total']['t']:+.1f}) against curv {fixed['curv']['mean']:+.1e}." in claims
    assert f"With the fix on, seed 1 (`on-s1`): no collapse in {fixed1_row['steps']:,} steps, layer 0 at most " \
           f"{layer(on1, 0)[1].max():.1f} (the fix off's past 100 at step {past(layer(s1, 0)):,}), layer 1 at most " \
           f"{on1_l1[1].max():.1f} ({on1_l1[1][-1]:.1f} at the end), val loss {at(val1, 62_000):.3f} at step 62,000 " \
           f"(the fix off's {at(s1.series('val_loss'), 62_000):.2f}); its probe total " \
           f"{fixed1['total']['mean']:+.1e} (t {fixed1['total']['t']:+.1f}) against curv " \
           f"{fixed1['curv']['mean']:+.1e}. With the fix on, seed 2 (`on-s2`): no collapse in {fixed2_row['steps']:,} " \
           f"steps, layer 0 at most {layer(on2, 0)[1].max():.1f} (the fix off's past 100 at step " \
           f"{past(layer(s2, 0)):,}), layer 1 at most {on2_l1[1].max():.1f} (the fix off's " \
           f"{layer(s2, 1)[1].max():.0f}), val loss {at(val2, 85_000):.3f} at step 85,000 (the fix off's " \
           f"{at(s2.series('val_loss'), 85_000):.2f}); its probe total {fixed2['total']['mean']:+.1e} " \
           f"(t {fixed2['total']['t']:+.1f}) against curv {fixed2['curv']['mean']:+.1e}. fp32 attention, seed 0 " \
           f"(`attn-fp32-s0`): no collapse in {control_row['steps']:,} steps, layer 1 at most {c_l1[1].max():.1f} " \
           f"(the fix off's {at(off_l1, 60_000):.0f} at step 60,000, {at(off_l1, 65_000):.0f} at 65,000), layer 0 at " \
           f"most {layer(control, 0)[1].max():.1f}, val loss {at(c_val, lowest[0][0]):.3f} at step {lowest[0][0]:,} " \
           f"(the fix off's {lowest[0][1]:.3f}); its probe total {control_probe['total']['mean']:+.1e} " \
           f"(t {control_probe['total']['t']:+.1f}) against curv {control_probe['curv']['mean']:+.1e}. Rotary " \
           f"positions, the fix off, seed 0 (`rope-s0`): no collapse in {rope_row['steps']:,} steps, every layer's max " \
           f"logit at most {rope_peak:.1f} (layer 1 at most {layer(rope, 1)[1].max():.1f}, layer 0 at most " \
           f"{layer(rope, 0)[1].max():.1f}), val loss {at(r_val, lowest[0][0]):.3f} at step {lowest[0][0]:,} (the fix " \
           f"off's {lowest[0][1]:.3f}); its probe total {rope_probe['total']['mean']:+.1e} (t " \
           f"{rope_probe['total']['t']:+.1f}) against curv {rope_probe['curv']['mean']:+.1e} |" in claims
    assert all(abs(probe[name, "total"]["mean"] - probe[name, "curv"]["mean"]) < 2 * probe[name, "total"]["se"]
               and probe[name, "total"]["t"] > 2 and abs(probe[name, "lin"]["t"]) < 2
               for name in ("off-s0", "off-s1", "off-s2"))


def test_memorisation_study_runs_its_controls_to_one_and_a_half_collapses():
    """studies.toml's memorisation study: each seed to 200,000 steps until its fix off has collapsed, then to 1.5x
    that collapse (up to the next 1,000), as its comment says; the fix on declared for exactly those seeds."""
    root = Path(analyze.__file__).parent
    study = load_study(root / "results/studies.toml", "memorisation")
    fell = {row["seed"]: row["collapse_step"] for row in read_table(root / "results/memorisation/runs.csv")
            if row["arm"] == "off" and row["collapsed"]}
    assert study.min_steps == {seed: -(-3 * fell[seed] // 2000) * 1000 if seed in fell else 200_000
                               for seed in study.min_steps}
    assert set(study.arms["on"][1]) == set(fell)


@pytest.mark.parametrize("name", ["memorisation", "lr_sweep"])
def test_results_readme_still_to_run_is_the_plan_less_its_runs(name):
    """A study's section of results/README.md names, as still to run, exactly the runs studies.toml declares and its
    runs.csv lacks."""
    root = Path(analyze.__file__).parent
    study = load_study(root / "results/studies.toml", name)
    made = {row["name"] for row in read_table(root / f"results/{name}/runs.csv")}
    declared = {f"{arm}-s{seed}" for arm, (_, seeds) in study.arms.items() for seed in seeds}
    text = doc_section("results/README.md", f"## {name}/", "<!-- all runs")
    assert set(re.findall(r"`([\w-]+)`", re.search(r"Still to run: ([^.]*)\.", text)[1])) == declared - made


def test_readme_memorisation_sentence_is_its_runs():
    """README's sentence on memorisation: the corpus preset's fix-off collapses, its lowest train loss, and where
    each run's val loss was lowest, against results/memorisation/."""
    root = Path(analyze.__file__).parent
    readme = " ".join((root / "README.md").read_text().split())
    off = sorted((row for row in read_table(root / "results/memorisation/runs.csv") if row["arm"] == "off"),
                 key=lambda row: row["seed"])
    runs = [load_run(root / "results/memorisation/runs" / row["name"]) for row in off]
    floor = min(np.nanmin(run.series("train_loss")[1]) for run in runs)
    lowest = [int(s[np.argmin(v)]) for s, v in (run.series("val_loss") for run in runs)]
    assert len(off) == 3 and all(row["collapsed"] for row in off)
    assert f"(`--preset corpus`; the fix off's train loss never below {np.floor(floor * 100) / 100:.2f}, its val " \
           f"loss lowest at steps {min(lowest):,}-{max(lowest):,}) fix off collapsed on seeds 0-2, at " \
           f"{off[0]['collapse_step']:,}, {off[1]['collapse_step']:,} and {off[2]['collapse_step']:,} steps" in readme
    rows = read_table(root / "results/memorisation/runs.csv")
    on = {row["seed"]: row for row in rows if row["arm"] == "on"}
    fp32 = {row["seed"]: row for row in rows if row["arm"] == "attn-fp32"}
    assert sorted(on) == [0, 1, 2] and not any(row["collapsed"] for row in on.values())
    rope = {row["seed"]: row for row in rows if row["arm"] == "rope"}
    assert sorted(fp32) == [0] and not fp32[0]["collapsed"] and sorted(rope) == [0] and not rope[0]["collapsed"]
    assert f"none with the fix on ({on[0]['steps']:,}, {on[1]['steps']:,} and {on[2]['steps']:,} steps), nor fp32 " \
           "attention or rotary positions (seed 0; section 10)" in readme


def fix_cost(root):
    """fix_cost.csv's forward+backward cost of the fix over fix off (per cent, paired rounds): (below seq 4k, from
    it), each a list over the shapes."""
    cost = bench.fix_ratios(root / "results/speed/fix_cost.csv")
    return tuple([100 * (r - 1) for (D, N), r in cost.items() if (N < 4096) == below] for below in (True, False))


def bench_ratios(path):
    """bench.csv's ratios for `fix="on"` ("ours_fix"): over `fix="off"` at every shape, to cuDNN from seq 4k
    (forward+backward), over torch's flash backend at every shape; "low-highx" each."""
    ms = {(row["impl"], row["head_dim"], row["seq"]): row for row in read_table(path)}
    shapes = [(D, N) for impl, D, N in ms if impl == "ours_fix"]
    ratio = lambda values: f"{analyze.between(list(values), '.2f')}x"
    over_off = ratio(ms["ours_fix", D, N]["fwd_bwd_ms"] / ms["ours", D, N]["fwd_bwd_ms"] for D, N in shapes)
    to_cudnn = ratio(ms["ours_fix", D, N]["fwd_bwd_vs_cudnn"] for D, N in shapes if N >= 4096)
    over_flash = ratio(ms["sdpa_flash", D, N]["fwd_bwd_ms"] / ms["ours_fix", D, N]["fwd_bwd_ms"] for D, N in shapes)
    return over_off, to_cudnn, over_flash


def test_kernel_md_speed_numbers_are_their_files():
    """docs/kernel.md's "Speed": the fix's cost (fix_cost.csv), the shift's in one H100 run (bench_h100.csv), the
    fix's in training (train_speed.txt), the kernel against cuDNN and torch's flash backend (bench.csv), the host's
    path (host_path/ and bench_before_host_path.csv)."""
    root = Path(analyze.__file__).parent
    speed = root / "results/speed"
    text = doc_section("docs/kernel.md", "## Speed", None)
    ratio = lambda values: f"{analyze.between(list(values), '.2f')}x"
    # fix_cost.csv: the fix's time over fix off's, paired per round; forward+backward as per cent
    fwd, bwd = (bench.fix_ratios(speed / "fix_cost.csv", column) for column in ("fwd_ms", "bwd_ms"))
    short, long = fix_cost(root)
    assert f"The fix costs at most 3% from seq 4k (at most {max(long):+.1f}%), more below it ({min(short):+.1f}% to " \
           f"{max(short):+.1f}% at seq 256-2k)" in text and max(long) <= 3 < min(short)
    assert f"fix off's {ratio(r for (D, N), r in fwd.items() if N == 256)} at seq 256, " \
           f"{ratio(r for (D, N), r in fwd.items() if N >= 4096)} from 4k; the backward, whose delta reads that O, " \
           f"{ratio(bwd.values())}" in text
    h100 = {(row["impl"], row["head_dim"], row["seq"]): row for row in read_table(speed / "bench_h100.csv")}
    shapes = [(D, N) for impl, D, N in h100 if impl == "ours_fix"]
    over_off = lambda impl, column: ratio(h100[impl, D, N][column] / h100["ours", D, N][column] for D, N in shapes)
    assert f"the forward of `fix=\"paper\"` is {over_off('ours_paper', 'fwd_ms')} fix off's in the same file, the " \
           f"fix's {over_off('ours_fix', 'fwd_ms')}" in text
    # bench_before_epilogue.csv: the one-pass backward (dQ by atomics) over the two-pass, fix off and the fix then
    epilogue = {(row["impl"], row["head_dim"], row["seq"]): row["bwd_ms"]
                for row in read_table(speed / "bench_before_epilogue.csv")}
    one_pass = lambda impl, at_16k: [epilogue[impl, D, N] / epilogue[f"{impl}_1pass", D, N]
                                     for name, D, N in epilogue if name == impl and (N == 16384) == at_16k]
    assert {N for _, _, N in epilogue} == {1024, 4096, 16384}
    assert f"ran the backward {ratio(one_pass('ours', True))} as fast at seq 16k without the fix and " \
           f"{ratio(one_pass('ours_fix', True))} with the fix as it then was (the shift and the fp32 O), at most " \
           f"{max(one_pass('ours', False) + one_pass('ours_fix', False)):.2f}x at seq 1k-4k" in text
    # train_speed.txt: two tables (the H200's, then the H100's), arm, steps, tokens/s
    tables = [{" ".join(line.split()[:-2]): (int(line.split()[-2]), float(line.split()[-1]))
               for line in block.splitlines() if line.startswith("--")}
              for block in (speed / "train_speed.txt").read_text().split("\narm ")[1:]]
    h200, h100_train = tables
    (on_steps, on), (off_steps, off) = h100_train["--fix on"], h100_train["--fix off"]
    assert on_steps == off_steps and f"`--fix on` trained {on / 1e6:.3f}M tokens/s and `--fix off` " \
                                      f"{off / 1e6:.3f}M, {on_steps:,} steps each" in text
    assert f"`--fix on` at that commit trained {h200['--fix on'][1] / 1e6:.2f}M tokens/s, `--attn sdpa` (cuDNN) " \
           f"{h200['--attn sdpa'][1] / 1e6:.2f}M, `--fix off` {h200['--fix off'][1] / 1e6:.2f}M" in text
    fix, cudnn, flash = bench_ratios(speed / "bench.csv")
    rows = {(row["impl"], row["head_dim"], row["seq"]): row for row in read_table(speed / "bench.csv")}
    big = [(D, N) for impl, D, N in rows if impl == "ours" and N >= 4096]
    off_cudnn = ratio(rows["ours", D, N]["fwd_bwd_vs_cudnn"] for D, N in big)
    low, high = (float(x) for x in fix.rstrip("x").split("-"))
    cost = f"{100 * (low - 1):.0f}-{100 * (high - 1):.0f}%"
    assert f"commit 660e7c7): forward+backward {flash} torch's flash backend at every length timed (seq 256 to 16k, " \
           f"head_dim 64 and 128), {cudnn} cuDNN at seq 4k-16k (`fix=\"off\"` {off_cudnn}), {cost} over " \
           "`fix=\"off\"`" in text
    assert f"From seq 1k the kernels: with the shift and the fp32 O together {cudnn} cuDNN at 4k-16k and {cost} over " \
           f"fix off (the fix alone at most {max(long):.1f}% from 4k" in text
    assert f"the forward at {ratio(rows['ours_fix', D, N]['fwd_vs_cudnn'] for D, N in big)} cuDNN's " \
           f"forward, the backward at {ratio(rows['ours_fix', D, N]['bwd_vs_cudnn'] for D, N in big)}" in text
    # the host's path: before (host_path_before.csv: "no op" skips the custom ops) and after (host_path.csv)
    host = lambda name: {(row["head_dim"], row["case"]): row for row in read_table(speed / "host_path" / name)
                         if row["seq"] == 256}
    before, after = host("host_path_before.csv"), host("host_path.csv")
    ms = lambda values, spec=".2f": analyze.between([v / 1000 for v in values], spec)
    dims = (64, 128)
    host_ms, kernel_ms = (ms([before[D, "fwd+bwd"][column] for D in dims], spec)
                          for column, spec in (("cpu_us", ".1f"), ("gpu_us", ".2f")))
    dispatch_ms = ms([before[D, "fwd+bwd"]["cpu_us"] - before[D, "fwd+bwd, no op"]["cpu_us"] for D in dims])
    assert f"At seq 256 an eager forward+backward cost the host {host_ms} ms against {kernel_ms} ms of kernels, " \
           f"{dispatch_ms} ms of it the custom ops' dispatch" in text
    old = {(row["head_dim"], row["seq"], row["impl"]): row["fwd_bwd_ms"]
           for row in read_table(speed / "bench_before_host_path.csv")}
    new = {(D, N, impl): row["fwd_bwd_ms"] for (impl, D, N), row in rows.items()}
    moved = ", ".join(f"{old[D, 256, 'ours_fix']:.2f} -> {new[D, 256, 'ours_fix']:.2f} ms "
                      f"({'head_dim 64' if D == 64 else D})" for D in dims)
    flash_ratio = lambda table: ratio(table[D, 256, "sdpa_flash"] / table[D, 256, "ours_fix"] for D in dims)
    assert f"256 {moved}, from {flash_ratio(old)} torch flash to {flash_ratio(new)}" in text
    launches = [row["cpu_us"] for (D, case), row in after.items() if case.startswith("launch ")]
    assert len(launches) == 8 and f"({ms([after[D, 'fwd+bwd']['cpu_us'] for D in dims])} ms of host a call, Triton's " \
           f"launcher {analyze.between(launches, '.0f')} us of it per launch, four a step)" in text


def test_kernel_md_correctness_table_names_tests_that_exist():
    """docs/kernel.md's table of correctness tests: each test it names is defined in the file its row names
    (`tests/FILE.py`: before the names), else in tests/test_kernels.py; a row naming a file alone names one that is."""
    root = Path(analyze.__file__).parent
    header = "| test (`tests/test_kernels.py` unless named) | checks |"
    table = (root / "docs/kernel.md").read_text().split(header)[1].split("\n\n")[0]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    assert len(rows) >= 15
    for cell in rows:
        for part in cell.split(";"):
            file = re.match(r"\s*`(tests/\w+\.py)`", part)
            names = re.findall(r"`(test_\w+)`", part)
            assert names or file, part
            source = (root / (file[1] if file else "tests/test_kernels.py")).read_text()
            assert all(f"\ndef {name}(" in source for name in names), part


def test_findings_tie_bias_is_the_mechanism_report():
    """findings 3 and results/README's claims row: the paper's rule against O's tie bias at two tied maxima (fa2), as
    results/mechanism/report.md's table of O's mean signed error gives it, over the rows it names."""
    root = Path(analyze.__file__).parent
    report = (root / "results/mechanism/report.md").read_text()
    rows = int(re.search(r"^(\d+) independent rows per k", report, re.M)[1])
    table = report.split("Mean signed error of O:")[1].split("\n\n")[1].splitlines()
    header = [cell.strip() for cell in table[0].strip("|").split("|")]
    two = [cell.strip() for cell in next(line for line in table if line.startswith("| 2 |")).strip("|").split("|")]
    cell = lambda flags: two[header.index(f"`{flags} --precision fa2`")].split()   # ["+3.84e-04", "(9.7e-07)"]
    short = lambda text: (lambda m, e: f"{m}e{int(e)}")(*text.split("e"))   # +3.84e-04 -> +3.84e-4
    (off, _), (paper, se) = cell("--fix off"), cell("--fix paper")
    findings = doc_section("docs/findings.md", "## 3. ", "## 4. ")
    assert f"over {rows:,} rows, `results/mechanism/report.md`, from {short(off)} to {short(paper)})" in findings
    t = float(paper) / float(se.strip("()"))
    claims = " ".join((root / "results/README.md").read_text().split())
    assert f"(fa2: O's mean error {short(off)} to {short(paper)}, t {t:.1f})" in claims


def shared_limit(root):
    """compile_sm90.py's SHARED_LIMIT, read from its source: the module refuses to import under the interpreter."""
    limits = re.search(r"^SHARED_LIMIT = \{(.*)\}$", (root / "nanolp/compile_sm90.py").read_text(), re.M)[1]
    return {int(arch): int(kb) * 1024 for arch, kb in re.findall(r"(\d+): (\d+) \* 1024", limits)}


def test_kernel_md_correctness_numbers_are_their_code():
    """docs/kernel.md's "Correctness evidence": the shared memory a block may have per GPU (nanolp/compile_sm90.py),
    the head_dim-128 forward's stages on the smaller ones (kernels.py), the bitwise tests' shapes."""
    import kernels
    root = Path(analyze.__file__).parent
    SHARED_LIMIT = shared_limit(root)
    text = doc_section("docs/kernel.md", "## Correctness evidence", "## Speed")
    assert f"fits the {SHARED_LIMIT[90] // 1024} KB of shared memory a block may have there" in text
    smaller = ", ".join(str(SHARED_LIMIT[arch] // 1024) for arch in (80, 86, 89))
    assert f"fit the shared memory a block may have there ({smaller} KB)" in text
    # kernels.py's tunings as the GPU runs them, read from its source: under the interpreter it runs others
    source = (root / "kernels.py").read_text()
    tuning = lambda name: eval(re.search(rf"^{name} = (.*)$", source, re.M)[1], {"FWD_TUNING": {}})
    stages, small = tuning("FWD_TUNING")[128][2], tuning("FWD_TUNING_SMALL_SHARED")[128][2]
    assert kernels.SMALL_SHARED == ((8, 6), (8, 9)) and stages > small
    assert f"the head_dim-128 forward, whose {stages} stages would take 128 KiB, takes {small} on sm_86 and sm_89" \
           in text
    shapes = re.search(r"^SHAPES = (\[.*\])$", (root / "tests/test_kernels.py").read_text(), re.M)[1]
    count = ["", "one", "two", "three", "four", "5", "6", "7"][len(eval(shapes))]
    assert f"bit for bit: {count} shapes (seq 1, odd lengths)" in text


def test_the_fused_exponents_residue_is_fp32s_spacing():
    """kernel.md and findings give the fused exponent's P at a row's max, 2^rho with rho up to half an fp32 ulp of
    the scaled logit (log2 units, as the kernel scales by kernels.LOG2E): at logits ~10, 1e6 and 1e9."""
    root = Path(analyze.__file__).parent
    rho = {logit: float(np.spacing(np.float32(logit * kernels.LOG2E))) / 2 for logit in (10, 1e6, 1e9)}
    at_1e6, at_1e9 = f"{100 * (2 ** rho[1e6] - 1):.0f}% at 1e6", f"2^{rho[1e9]:.0f} at 1e9"
    kernel_md = " ".join((root / "docs/kernel.md").read_text().split())
    assert f"nothing at ordinary logits (2^{np.log2(rho[10]):.0f} at ~10), {at_1e6}, {at_1e9};" in kernel_md
    assert f"nothing at logits ~10, {at_1e6}, {at_1e9}, and a one-hot row's" in doc_section("docs/findings.md", "## 5. ",
                                                                                           "## 6. ")


def test_results_readme_names_the_collapses_counted_from_0():
    """results/README.md's rows whose collapse_step counted the non-finite step from 0: every committed row whose
    reason is a non-finite loss (train.py now counts it as the log does)."""
    root = Path(analyze.__file__).parent
    rows = [(table.parent.name, row["name"]) for table in sorted((root / "results").glob("*/*runs.csv"))
            for row in read_table(table) if str(row.get("reason") or "").startswith("non-finite loss")]
    assert sorted(rows) == sorted([("default_search", "lr3e-3-off-s0-run4"), ("seed_study", "off-s2")] + [
        ("seed_study", f"{arm}-s{seed}-nolog") for arm, seed in (("off", 0), ("off", 1), ("off", 2), ("off", 5),
                                                                   ("off", 7), ("paper", 1))])
    text = " ".join((root / "results/README.md").read_text().split())
    assert f"the {['', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine'][len(rows)]} rows " \
           "whose `reason` is a non-finite loss (`seed_study`'s `off-s2` and its six `-nolog` rows of that reason, " \
           "`default_search`'s `lr3e-3-off-s0-run4`) come from a train.py that counted that step from 0" in text
