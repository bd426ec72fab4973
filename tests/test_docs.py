"""README.md's numbers and tables against the committed files they come from (analyze.py regenerates them)."""

import math
import re
from pathlib import Path

import numpy as np

import analyze
from nanolp.runs import load_run, read_table


def test_readme_tables_are_the_study_tables_of_their_runs_csv():
    """Each of README.md's study tables is regenerated from its runs.csv (python analyze.py --table), never typed."""
    root = Path(analyze.__file__).parent
    text = (root / "README.md").read_text()
    tables = re.findall(r"<!-- table: python analyze.py --table (\S+) -->\n", text)
    assert {"results/seed_study/runs.csv", "results/stochastic_rounding/runs.csv"} <= set(tables)
    for table in map(Path, tables):
        lines = analyze.study_table(read_table(root / table), root / table.parent)
        block = text.split(f"<!-- table: python analyze.py --table {table} -->\n")[1]
        assert block.split("<!-- end of table -->")[0] == "\n".join(lines) + "\n", table


def test_readme_promise_is_the_shipped_kernels_runs():
    """The quick start's promise for `--fix off` (steps to the collapse, minutes alone) is what runs.csv says of the
    fix-off runs of the kernel as it ships (arm off-fma) and README's table line on their pace."""
    root = Path(analyze.__file__).parent
    readme = (root / "README.md").read_text()
    rows = [row for row in read_table(root / "results/seed_study/runs.csv") if row["arm"] == "off-fma"]
    steps = sorted(row["collapse_step"] for row in rows if row["collapsed"])
    assert len(steps) == len(rows) >= 2
    promise = next(line for line in readme.splitlines() if "python train.py --fix off    #" in line)
    assert f"collapses: steps {steps[0]:,}-{steps[-1]:,}" in promise
    minutes = re.search(r"the kernel as it ships \(`off-fma`\).* after ([\d.]+) \(([\d.]+)-([\d.]+)\) minutes", readme)
    low, high = float(minutes[2]), float(minutes[3])
    assert f"{math.floor(low)}-{math.ceil(high)} min alone" in promise


def test_readme_ranges_are_the_runs():
    """README's "what you will see": the fix-off runs' layer 0 passing 100 (their kept logs) and the fix-on runs'
    final val loss (runs.csv) are what the committed runs say."""
    root = Path(analyze.__file__).parent
    readme = " ".join((root / "README.md").read_text().split())
    study = root / "results/seed_study"
    rows = read_table(study / "runs.csv")
    passes = []
    for row in rows:
        if row["log_kept"] and row["fix"] == "off" and row["attn"] == "kernel":
            steps, logits = load_run(study / "runs" / row["name"]).series(analyze.LOGIT)
            passes.append(int(steps[np.argmax(logits > 100)]))
    assert len(passes) >= 4 and f"passes 100 at {min(passes):,}-{max(passes):,} steps" in readme
    val = [row["final_val_loss"] for row in rows if row["arm"] == "on"]
    assert f"val loss rising to {min(val):.1f}-{max(val):.1f} nats at the end of the fix-on runs" in readme
