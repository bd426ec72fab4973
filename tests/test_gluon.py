"""kernels_gluon.py on the CPU: every launch compiles for sm_90 (no spills, registers, the exponent's fma the only
one), the host code's checks, and the GPU check script's arguments and tables. Its numbers are the GPU's job
(python -m experiments.gluon_check). Skipped where this Triton has no Gluon for Hopper."""
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels

pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper", reason="this Triton has no Gluon for Hopper")
try:
    from experiments import kernels_gluon
except (ImportError, AttributeError) as error:   # a Gluon without the API the kernels use
    pytest.skip(f"kernels_gluon does not import: {error}", allow_module_level=True)
from experiments import gluon_check  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU experiments.gluon_check runs them")
def test_every_launch_compiles_for_sm90():
    """experiments/compile_gluon_sm90.py in a process without the interpreter (Gluon has none): exit 0 only if every
    launch compiles with no spills, within the registers, with one fma per score and no other."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "experiments.compile_gluon_sm90"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if " registers, " in line]
    assert len(lines) == len(kernels_gluon.VARIANTS) * 12, done.stdout     # 2 head_dims x causal x 3 fixes
    assert all("PROBLEM" not in line for line in lines)


def q_of(shape=(1, 2, 100, 64), dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


@pytest.mark.parametrize("args, error, message", [
    (dict(q=q_of((1, 2, 100, 32))), ValueError, "head_dim 64 or 128, got 32"),
    (dict(q=q_of((1, 2, 100, 16))), ValueError, "head_dim 64 or 128, got 16"),
    (dict(q=q_of(dtype=torch.float32)), TypeError, "bfloat16 or float16"),
    (dict(k=q_of((1, 2, 99, 64))), ValueError, "same shape"),
    (dict(q=q_of((1, 2, 64, 100)).transpose(-1, -2)), ValueError, "contiguous in its last dimension"),
    (dict(fix="maybe"), ValueError, 'fix must be "off", "on" or "paper"'),
    (dict(causal=1), ValueError, "causal must be True or False"),
    (dict(variant="fast"), ValueError, "variant must be one of"),
])
def test_host_checks(args, error, message):
    q = args.pop("q", q_of())
    k, v = args.pop("k", torch.zeros_like(q)), torch.zeros_like(q)     # (zeros_like keeps q's strides)
    with pytest.raises(error, match=message):
        kernels_gluon.forward(q, k, v, **{"fix": "on", **args})


def test_tma_needs_aligned_strides():
    q = torch.zeros(1, 2, 100, 68, dtype=torch.bfloat16)[..., :64]    # rows of 136 bytes: TMA cannot read them
    kernels_gluon.check(q, q, q, True, "on", "sync")
    with pytest.raises(ValueError, match='variant "tma" needs q 16-byte aligned'):
        kernels_gluon.check(q, q, q, True, "on", "tma")


def test_cpu_tensors_are_refused():
    q = q_of()
    with pytest.raises(ValueError, match="sm_90 GPU"):
        kernels_gluon.forward(q, q, q, fix="on")


def test_fix_wiring(monkeypatch):
    """fix reaches the launch as itself: "off", no shift, no fp32 O; "on", the fp32 O alone; "paper", the shift alone
    (as kernels.flash_fwd launches them)."""
    launches = []

    class Recorder:   # stands in for the kernel: records a launch's meta-parameters instead of running it
        def __getitem__(self, grid):
            return lambda *args, **meta: launches.append(meta)
    monkeypatch.setattr(kernels_gluon, "_fwd_sync", Recorder())
    q = q_of()
    for fix in ("off", "on", "paper"):
        kernels_gluon.launch(q, q, q, True, fix, "sync")
    assert [(meta["SHIFT"] is not None, meta["KEEP_O32"]) for meta in launches] == [
        (False, False), (False, True), (True, False)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_check_script_needs_a_gpu_and_an_out_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as done:
        gluon_check.main([])
    assert done.value.code == 2 and "--out" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        gluon_check.main(["--out", str(tmp_path)])
    assert done.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err


def test_check_script_tables(tmp_path):
    correct = [dict(variant="sync", head_dim=128, causal=True, fix="on", seq=1000, layout="bnhd", verdict="bitwise",
                    o_vs_kernels="bitwise", o_maxdiff=0.0, o_rel_err=1.5e-3, plain_rel_err=2.5e-3),
               dict(variant="sync", head_dim=64, causal=False, fix="off", seq=1, layout="bhnd",
                    verdict="ERROR RuntimeError: boom")]
    timed = [dict(impl="gluon-sync fix=on", head_dim=128, seq=4096, batch=4, heads=16, fwd_ms=0.75,
                  fwd_tflops=366.4, vs_kernels_same_fix=1.15, vs_cudnn=float("nan"))]
    text = gluon_check.write(tmp_path, correct, timed, "header")
    assert "| sync | 128 | True | on | 1000 | bnhd | bitwise | bitwise | 0 |" in text
    assert "| sync | 64 | False | off | 1 | bhnd | ERROR RuntimeError: boom |" in text
    assert "| gluon-sync fix=on | 128 | 4096 | 4 | 16 | 0.75 | 366 | 1.15 |  |" in text
    assert (tmp_path / "gluon_check.md").read_text() == text + "\n"
    with open(tmp_path / "speed.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows[0]["impl"] == "gluon-sync fix=on" and float(rows[0]["fwd_ms"]) == 0.75
    with open(tmp_path / "correctness.csv", newline="") as f:
        assert [r["verdict"] for r in csv.DictReader(f)] == ["bitwise", "ERROR RuntimeError: boom"]
    assert (tmp_path / "sharp_rows.csv").read_text().startswith("impl,seed,fix,")


def test_check_script_ratios():
    rows = [dict(impl=name, head_dim=128, seq=4096, fwd_ms=ms) for name, ms in
            (("kernels fix=on", 2.0), ("gluon-sync fix=on", 1.0), ("sdpa cudnn", 1.5), ("gluon-sync fix=off", 1.0))]
    got = {r["impl"]: (r["vs_kernels_same_fix"], r["vs_cudnn"]) for r in gluon_check.ratios(rows)}
    assert got["gluon-sync fix=on"] == (2.0, 1.5) and got["kernels fix=on"] == (1.0, 0.75)
    assert got["gluon-sync fix=off"][1] == 1.5 and got["gluon-sync fix=off"][0] != got["gluon-sync fix=off"][0]  # nan


@pytest.mark.skipif(torch.cuda.is_available(), reason="a child that fails: the CPU's refusal")
def test_check_script_reports_a_failed_part_and_goes_on(tmp_path):
    """A variant's process that fails (here: no GPU) leaves an error row, not a crash; rows of an earlier run of
    that part are not read as this run's."""
    (tmp_path / "correctness_sync.csv").write_text("variant,verdict\nsync,bitwise\n")
    rows = gluon_check.run_part("sync", str(tmp_path), timeout=120, no_speed=True)
    correct = rows["correctness"]
    assert rows["speed"] == rows["sharp_rows"] == [] and len(correct) == 1
    assert correct[0]["variant"] == "sync" and correct[0]["verdict"].startswith("ERROR exit 2")
    assert "needs a CUDA GPU" in correct[0]["verdict"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fix", ["off", "on"])
def test_check_script_compares_against_kernels_and_float64(fix, monkeypatch):
    """gluon_check's correctness case, the Gluon forward stood in for by kernels.forward itself (bitwise), then by
    one whose O is a bf16 ulp off in one element (no longer bitwise, still within the float64 bound), then by one
    whose O is wrong in one row (FAIL): the verdicts the GPU run gives."""
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def stand_in(change):
        def forward(q, k, v, causal, fix, variant):
            o, lse, o32 = kernels.forward(q, k, v, causal=causal, fix=fix)
            return change(o.clone()), lse, o32
        return forward

    def one_ulp(o):
        o.view(torch.int16)[0, 0, 5, 3] += 1
        return o

    def wrong_row(o):
        o[0, 0, 5] = 1.0
        return o

    for change, verdict in ((lambda o: o, "bitwise"), (one_ulp, "within"), (wrong_row, "FAIL")):
        monkeypatch.setattr(kernels_gluon, "forward", stand_in(change))
        row = gluon_check.check_case("sync", 64, True, fix, 63, "bnhd", device=device)
        assert row["verdict"] == verdict, row
        assert (row["o_vs_kernels"] == "bitwise") == (verdict == "bitwise")
        assert row["lse_vs_kernels"] == "bitwise" and row.get("o32_vs_kernels", "bitwise") == "bitwise"


def test_check_script_sharp_rows(monkeypatch):
    """The sharp-rows measure, kernels.forward standing in for the Gluon forward: delta from the bf16 O errs with
    one sign (fix "off"), from the fp32 O its mean is two orders smaller (fix "on"; under the interpreter within noise
    of zero, on a GPU a few standard errors from it, t ~ 40 against fix off's ~ -110)."""
    monkeypatch.setattr(kernels_gluon, "forward", lambda q, k, v, causal, fix, variant: kernels.forward(
        q, k, v, causal=causal, fix=fix))
    rows = gluon_check.sharp_rows("sync", device="cuda" if torch.cuda.is_available() else "cpu", seeds=(0,))
    assert len(rows) == 4
    off = [r for r in rows if r["fix"] == "off"]
    on = [r for r in rows if r["fix"] == "on"]
    assert all(r["t"] < -10 for r in off), off
    for a in off:
        for b in on:
            if (a["impl"], a["seed"]) == (b["impl"], b["seed"]):
                assert abs(b["delta_mean_err"]) < 0.02 * abs(a["delta_mean_err"]), (a, b)
