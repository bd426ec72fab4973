"""README's speed table is experiments/bench.py's table of the committed benchmark, never typed."""
from pathlib import Path

from experiments import bench

ROOT = Path(__file__).resolve().parent.parent


def test_readme_speed_table_is_the_benchmarks():
    begin = "<!-- speed: python -m experiments.bench --table results/speed/bench.csv -->"
    text = (ROOT / "README.md").read_text()
    assert begin in text, "README.md has lost its speed table's marker"
    lines = text.split(begin, 1)[1].split("<!-- end of speed -->", 1)[0].strip().splitlines()
    assert lines == bench.speed_table(ROOT / "results" / "speed" / "bench.csv")


def test_fix_cost_table_is_fix_on_over_fix_off(tmp_path):
    rows = [("ours", 64, 256, 1.0), ("ours_fix", 64, 256, 1.03), ("ours", 64, 4096, 2.0), ("ours_fix", 64, 4096, 1.9),
            ("ours", 128, 256, 4.0), ("ours_fix", 128, 256, 5.0), ("ours", 128, 4096, 1.0), ("ours_fix", 128, 4096, 1.0),
            ("sdpa_cudnn", 64, 256, 0.5)]
    path = tmp_path / "bench.csv"
    path.write_text("impl,head_dim,seq,fwd_bwd_ms\n" + "".join(f"{i},{d},{n},{t}\n" for i, d, n, t in rows))
    assert bench.fix_cost_table(path) == ["| head_dim | 256 | 4,096 |", "|---|---|---|",
                                          "| 64 | +3.0% | -5.0% |", "| 128 | +25.0% | +0.0% |"]


def test_kernel_md_fix_cost_table_is_the_benchmarks():
    begin = "<!-- cost: python -m experiments.bench --cost results/speed/fix_cost.csv -->"
    text = (ROOT / "docs" / "kernel.md").read_text()
    assert begin in text, "docs/kernel.md has lost its cost table's marker"
    lines = text.split(begin, 1)[1].split("<!-- end of cost -->", 1)[0].strip().splitlines()
    assert lines == bench.fix_cost_table(ROOT / "results" / "speed" / "fix_cost.csv")


def test_fix_cost_is_the_median_over_rounds_of_the_paired_ratio(tmp_path):
    """With --repeats, each round's fix time over the same round's fix-off time; a slow round of both cancels."""
    rounds = [(1.0, 1.02), (2.0, 2.10), (1.0, 1.01)]   # round 1: the GPU at half speed, both timings alike
    path = tmp_path / "bench.csv"
    path.write_text("impl,head_dim,seq,repeat,fwd_bwd_ms\n" + "".join(
        f"ours,64,1024,{r},{off}\nours_fix,64,1024,{r},{on}\n" for r, (off, on) in enumerate(rounds)))
    assert bench.fix_cost_table(path)[2] == "| 64 | +2.0% |"   # the ratios 1.02, 1.05, 1.01: their median
