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
