"""README's speed table is experiments/bench.py's table of the committed benchmark, never typed; what bench refuses."""
from pathlib import Path

import pytest

from experiments import bench

ROOT = Path(__file__).resolve().parent.parent


def test_readme_speed_table_is_the_benchmarks():
    begin = "<!-- speed: python -m experiments.bench --table results/speed/bench_h100.csv -->"
    text = (ROOT / "README.md").read_text()
    assert begin in text, "README.md has lost its speed table's marker"
    lines = text.split(begin, 1)[1].split("<!-- end of speed -->", 1)[0].strip().splitlines()
    assert lines == bench.speed_table(ROOT / "results" / "speed" / "bench_h100.csv")


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


def refused(argv, capsys):
    """bench.main's refusal of argv: exit status 2 and its one line of error, as argparse refuses a flag."""
    with pytest.raises(SystemExit) as exited:
        bench.main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_a_file_that_is_no_bench_csv_is_one_line(tmp_path, capsys):
    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xd0\xff")
    fix_cost = ROOT / "results" / "speed" / "fix_cost.csv"   # no sdpa_flash rows: no speed table
    for argv, line in ((["--table", "nope.csv"], "No such file or directory: 'nope.csv'"),
                       (["--cost", str(binary)], f"{binary} is not UTF-8 text"),
                       (["--table", str(fix_cost)], f"{fix_cost} has no rows of sdpa_flash at seq 4096 to 16384, "
                                                    f"head_dim 64"),
                       (["--cost", str(ROOT / "results" / "cure" / "runs.csv")], "is not a bench CSV: no column impl")):
        assert line in refused(argv, capsys)


def test_two_benchmarks_joined_are_one_line_never_one_of_them_kept(tmp_path, capsys):
    """A CSV with two timings of one implementation at one shape in one round (two benchmarks concatenated): the
    cost table would keep the later silently and the speed table would span both; each refuses in one line."""
    one = "".join(f"{impl},64,{n},0,{ms},0.8\n" for impl, ms in (("ours", 1.0), ("ours_fix", 1.1))
                  for n in (4096, 8192, 16384)) + "".join(f"{impl},64,{n},0,1.0,0.8\n" for impl in bench.TABLE_IMPLS
                                                         if impl not in ("ours", "ours_fix") for n in (4096, 8192, 16384))
    path = tmp_path / "bench.csv"
    path.write_text("impl,head_dim,seq,repeat,fwd_bwd_ms,fwd_bwd_vs_cudnn\n" + one)
    assert bench.fix_cost_table(path)[2] == "| 64 | +10.0% | +10.0% | +10.0% |" and bench.speed_table(path)
    path.write_text("impl,head_dim,seq,repeat,fwd_bwd_ms,fwd_bwd_vs_cudnn\n" + one + "ours_fix,64,8192,0,1.5,0.6\n")
    for flag in ("--cost", "--table"):
        assert refused([flag, str(path)], capsys).endswith(
            f"{path} has two rows of ours_fix at head_dim 64, seq 8192, round 0: one benchmark's CSV has one")


def test_a_cell_that_is_no_number_is_one_line_never_a_nan_in_the_table(tmp_path, capsys):
    """A ratio of nan (timed without cuDNN) or a blank shape: one line naming the file and the row, not a table of
    "nanx" (or, where the nan fell in the middle of a range, one that reads as whole); --table with --cost refused."""
    header = "impl,head_dim,seq,fwd_bwd_ms,fwd_bwd_vs_cudnn\n"
    rows = [f"{impl},64,{n},1.0,0.8\n" for impl in bench.TABLE_IMPLS for n in (4096, 8192, 16384)]
    for cell, bad in ((("ours_fix,64,8192,1.0,0.8", "ours_fix,64,8192,1.0,nan"), "fwd_bwd_vs_cudnn ('nan')"),
                      (("ours,64,4096,1.0,0.8", "ours,64,,1.0,0.8"), "seq ('')")):
        path = tmp_path / "bench.csv"
        path.write_text(header + "".join(rows).replace(*cell))
        line = refused(["--table", str(path)], capsys)
        assert line.endswith(bad) and f"{path}: the row of " in line
    assert "give one of them" in refused(["--table", str(path), "--cost", str(path)], capsys)


def test_timing_refuses_bad_shapes_no_gpu_and_no_rows_without_touching_out(tmp_path, capsys, monkeypatch):
    out = tmp_path / "bench.csv"
    out.write_text("a committed benchmark\n")
    assert refused(["--seqs", "0", "--out", str(out)], capsys).endswith("--seqs and --head-dims must be 1 or more")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    assert "timing needs a CUDA GPU" in refused(["--out", str(out)], capsys)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "measure", lambda *args: [])   # every implementation raised
    assert refused(["--out", str(out)], capsys).endswith(f"no implementation ran at any shape: {out} left as it was")
    assert out.read_text() == "a committed benchmark\n"
    monkeypatch.setattr(bench, "measure", lambda *args: pytest.fail("timed before --out was checked"))
    assert refused(["--out", str(tmp_path)], capsys).endswith(f"--out must be a file: {tmp_path} is a folder")
