"""kernels_gluon.py's forward on an H100/H200: correct against kernels.py's forward and float64, then timed.

    python -m experiments.gluon_check --out DIR [--variants sync tma ws] [--timeout 120] [--no-speed]
                                                       # CUDA sm_90; a few minutes on an H200

Correctness, per variant, head_dim 64/128, causal or not, fix "off"/"on", sequence lengths 63, 1000, 4096, q, k,
v laid out (batch, heads, seq, head_dim) or as head views of (batch, seq, channels): O, lse and (fix "on") the fp32
O against kernels.forward's, bit for bit ("bitwise") or not (the mismatching elements and the largest difference),
and against float64 attention: O within twice plain bf16 attention's error (tests/test_kernels.py's bound), lse
within twice kernels.py's error. Verdict: "bitwise", "within" or "FAIL".
Speed: bf16, causal, experiments/bench.py's shapes (batch x heads holding 16k tokens x 2048 channels), seq 1024,
4096, 16384, head_dim 64/128, the forward alone (median ms, triton.testing.do_bench): each Gluon variant and
kernels.py's forward at fix "off" and "on", torch SDPA's cuDNN and flash backends; ratios to kernels.py's forward
at the same fix and to cuDNN's forward.
Sharp rows (tests/test_mechanism.py's): the mean error of the delta the backward reads against float64, from the
bf16 O with fix "off" (one-signed) and from the fp32 O with fix "on" (within noise of zero), the Gluon forward's
beside kernels.py's.
Writes DIR/correctness.csv, DIR/sharp_rows.csv, DIR/speed.csv and DIR/gluon_check.md (the three tables), and prints
the tables. Each variant runs in a process of its own (the baselines in another), stopped after --timeout seconds: a
variant that fails to compile, crashes or hangs is reported in its rows and the run goes on.
"""
import argparse
import csv
import math
import os
import subprocess
import sys
import time
import traceback

import torch
import triton
from torch.nn.attention import SDPBackend
from triton.testing import do_bench

import kernels
from experiments import kernels_gluon
from experiments.bench import sdpa
from experiments.tied import exact_scores, mean_error, tied_rows
from nanolp.runs import read_rows

LOG2E = math.log2(math.e)
SEQS = (63, 1000, 4096)      # two specializations of N (not and divisible by 16): few compiles
BASELINES = "baselines"      # the part that times kernels.py's forward and SDPA's
SPEED_SEQS = (1024, 4096, 16384)
TOKENS, CHANNELS = 16384, 2048          # experiments/bench.py's


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def reference(q, k, v, causal):
    """float64 attention on the same inputs: O and lse in log2 units (kernels.py's "fa2" lse)."""
    s = exact_scores(q, k, causal)
    return s.softmax(-1) @ v.double(), torch.logsumexp(s, -1) * LOG2E


def plain(q, k, v, causal):
    """PyTorch's attention in bf16 without flash attention (tests/test_kernels.py's plain_attention)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        n = q.shape[-2]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.softmax(s, -1) @ v


def inputs(B, H, N, D, layout, seed, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (B, H, N, D) if layout == "bhnd" else (B, N, H, D)
    qkv = [torch.randn(shape, device=device, generator=g).to(torch.bfloat16) for _ in range(3)]
    return [t if layout == "bhnd" else t.transpose(1, 2) for t in qkv]


def compare(a, b):
    """'bitwise', or the number of differing elements and the largest absolute difference."""
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} vs {tuple(b.shape)}", math.inf
    diff = a.double() - b.double()
    same = (a == b) | (torch.isnan(a) & torch.isnan(b))
    if bool(same.all()):
        return "bitwise", 0.0
    return f"{int((~same).sum())}/{a.numel()} differ", float(diff.abs().max())


def check_case(variant, D, causal, fix, N, layout, device="cuda"):
    B, H = (2, 3) if N <= 1000 else (1, 2)
    q, k, v = inputs(B, H, N, D, layout, seed=N + D, device=device)
    o, lse, o32 = kernels_gluon.forward(q, k, v, causal=causal, fix=fix, variant=variant)
    want = kernels.forward(q, k, v, causal=causal, fix=fix)
    o_ref, lse_ref = reference(q, k, v, causal)
    row = dict(variant=variant, head_dim=D, causal=causal, fix=fix, seq=N, batch=B, heads=H, layout=layout)
    row["o_vs_kernels"], row["o_maxdiff"] = compare(o, want.o)
    row["lse_vs_kernels"], row["lse_maxdiff"] = compare(lse, want.lse)
    if fix == "on":
        row["o32_vs_kernels"], row["o32_maxdiff"] = compare(o32, want.o_delta)
    row["o_rel_err"], row["plain_rel_err"] = rel(o, o_ref), rel(plain(q, k, v, causal), o_ref)
    row["lse_err"] = float((lse.double() - lse_ref).abs().max())
    row["kernels_lse_err"] = float((want.lse.double() - lse_ref).abs().max())
    bitwise = all(row.get(key, "bitwise") == "bitwise" for key in ("o_vs_kernels", "lse_vs_kernels", "o32_vs_kernels"))
    within = (torch.isfinite(o.float()).all() and row["o_rel_err"] <= 2 * row["plain_rel_err"] + 1e-5
              and row["lse_err"] <= 2 * row["kernels_lse_err"] + 1e-6)
    row["verdict"] = "bitwise" if bitwise and within else "within" if within else "FAIL"
    return row


def first_line(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[-1][:200] if lines else ''}"


def correctness(variants):
    rows = []
    for variant in variants:
        for D in (64, 128):
            for causal in (True, False):
                for fix in ("off", "on"):
                    for N in SEQS:
                        for layout in ("bhnd", "bnhd") if N == 1000 else ("bhnd",):
                            try:
                                rows.append(check_case(variant, D, causal, fix, N, layout))
                            except Exception as error:   # one variant's failure must not end the run
                                traceback.print_exc()
                                rows.append(dict(variant=variant, head_dim=D, causal=causal, fix=fix, seq=N,
                                                 layout=layout, verdict=f"ERROR {first_line(error)}"))
    return rows


def sharp_inputs(seed, rows=1024):
    """tests/test_mechanism.py's sharp rows: each row's one top key holds >= 1 - 1e-3 of the weight, dO points from
    its V toward the others'; delta from the bf16 O then errs with one sign (fix "off"), from the fp32 O not."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = tied_rows(rows, 1, generator=g)
    top = (q.double() @ k.double().transpose(-1, -2)).argmax(-1, keepdim=True)
    v_top = torch.gather(v.double(), 2, top.expand(-1, -1, -1, v.shape[-1]))
    do = v.double().mean(2, keepdim=True) - v_top + 0.5 * torch.randn(v_top.shape, generator=g, dtype=torch.float64)
    return q, k, v, do.bfloat16()


def sharp_rows(variant, device="cuda", seeds=(0, 1)):
    """Mean error (s.e.) of the delta the backward reads, against float64, on sharp rows: from the bf16 O with fix
    "off", from the fp32 O with fix "on"; the Gluon forward's and kernels.py's."""
    rows = []
    for seed in seeds:
        q, k, v, do = sharp_inputs(seed)
        exact = (do.double() * reference(q, k, v, False)[0]).sum(-1)
        q, k, v = (t.to(device) for t in (q, k, v))
        for fix in ("off", "on"):
            o, _, o32 = kernels_gluon.forward(q, k, v, causal=False, fix=fix, variant=variant)
            want = kernels.forward(q, k, v, causal=False, fix=fix)
            for impl, read in ((f"gluon-{variant}", o32 if fix == "on" else o),
                               ("kernels", want.o_delta if fix == "on" else want.o)):
                mean, se = mean_error((do.double() * read.cpu().double()).sum(-1) - exact)
                rows.append(dict(impl=impl, seed=seed, fix=fix, delta_mean_err=mean, delta_se=se, t=mean / se))
    return rows


def impls(part):
    """The forwards a part times: "baselines" (kernels.py's at each fix, SDPA's cuDNN and flash) or one variant."""
    if part == BASELINES:
        return {"kernels fix=off": lambda q, k, v: kernels.forward(q, k, v, causal=True, fix="off"),
                "kernels fix=on": lambda q, k, v: kernels.forward(q, k, v, causal=True, fix="on"),
                "sdpa cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "sdpa flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    return {f"gluon-{part} fix={fix}": (lambda fix: lambda q, k, v: kernels_gluon.forward(
        q, k, v, causal=True, fix=fix, variant=part))(fix) for fix in ("off", "on")}


def speed(part):
    rows = []
    for D in (64, 128):
        for N in SPEED_SEQS:
            B, H = max(1, TOKENS // N), CHANNELS // D
            q, k, v = inputs(B, H, N, D, "bhnd", seed=0)
            flops = 4 * B * H * N * N * D / 2
            for name, fn in impls(part).items():
                try:
                    with torch.no_grad():
                        ms = do_bench(lambda: fn(q, k, v), return_mode="median")
                except Exception as error:
                    print(f"{name} D={D} N={N}: {first_line(error)}")
                    continue
                rows.append(dict(impl=name, head_dim=D, seq=N, batch=B, heads=H, fwd_ms=ms,
                                 fwd_tflops=flops / ms * 1e-9))
    return rows


def ratios(rows):
    """Each row's speed against kernels.py's forward at the same fix and cuDNN's forward (> 1: faster)."""
    ms = {(r["impl"], r["head_dim"], r["seq"]): r["fwd_ms"] for r in rows}
    for r in rows:
        fix = r["impl"].rsplit("fix=", 1)[1] if "fix=" in r["impl"] else None
        base, cudnn = ms.get((f"kernels fix={fix}", r["head_dim"], r["seq"])), ms.get(("sdpa cudnn", r["head_dim"],
                                                                                       r["seq"]))
        r["vs_kernels_same_fix"] = base / r["fwd_ms"] if base else float("nan")
        r["vs_cudnn"] = cudnn / r["fwd_ms"] if cudnn else float("nan")
    return rows


def fmt(value):
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.3g}"
    return str(value)


def markdown(rows, columns):
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c, "")) for c in columns) + " |" for r in rows]
    return lines


CORRECTNESS_COLUMNS = ["variant", "head_dim", "causal", "fix", "seq", "layout", "verdict", "o_vs_kernels", "o_maxdiff",
                       "lse_vs_kernels", "lse_maxdiff", "o32_vs_kernels", "o32_maxdiff", "o_rel_err", "plain_rel_err",
                       "lse_err", "kernels_lse_err"]
SHARP_COLUMNS = ["impl", "seed", "fix", "delta_mean_err", "delta_se", "t"]
SPEED_COLUMNS = ["impl", "head_dim", "seq", "batch", "heads", "fwd_ms", "fwd_tflops", "vs_kernels_same_fix", "vs_cudnn"]


def write(out, correct, timed, header, sharp=()):
    os.makedirs(out, exist_ok=True)
    for name, rows, columns in (("correctness.csv", correct, CORRECTNESS_COLUMNS), ("speed.csv", timed, SPEED_COLUMNS),
                                ("sharp_rows.csv", sharp, SHARP_COLUMNS)):
        with open(os.path.join(out, name), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    text = [f"# Gluon forward check\n\n{header}\n\n## Correctness\n", *markdown(correct, CORRECTNESS_COLUMNS),
            "\n## Sharp rows: the error of the delta the backward reads, against float64 (head_dim 64, 64 keys)\n",
            *markdown(sharp, SHARP_COLUMNS),
            "\n## Forward speed (bf16, causal, 16k tokens x 2048 channels)\n", *markdown(timed, SPEED_COLUMNS)]
    with open(os.path.join(out, "gluon_check.md"), "w") as f:
        f.write("\n".join(text) + "\n")
    return "\n".join(text)


def read_csv(path):
    rows = read_rows(path)
    for r in rows:
        for key, value in r.items():
            try:
                r[key] = int(value)
            except ValueError:
                try:
                    r[key] = float(value)
                except ValueError:
                    pass
    return rows


PARTS = ("correctness", "sharp_rows", "speed")     # each part's CSVs, {name}_{part}.csv


def run_part(part, out, timeout, no_speed):
    """One variant (or the baselines) in a child process: its rows {name: rows} for PARTS' names, with an error row
    in "correctness" where it failed or hung."""
    for name in PARTS:   # no rows of an earlier run
        if os.path.exists(os.path.join(out, f"{name}_{part}.csv")):
            os.remove(os.path.join(out, f"{name}_{part}.csv"))
    cmd = [sys.executable, "-m", "experiments.gluon_check", "--out", out, "--part", part] + (["--no-speed"] if no_speed
                                                                                              else [])
    try:
        done = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        print(done.stdout + done.stderr[-4000:], end="")
        failure = None if done.returncode == 0 else f"ERROR exit {done.returncode}: {done.stderr.strip()[-200:]}"
    except subprocess.TimeoutExpired:
        failure = f"ERROR no result within {timeout:g} s (a hang?)"
    rows = {name: [] for name in PARTS}
    for name in PARTS:   # read, then removed: the merged tables are the run's files
        path = os.path.join(out, f"{name}_{part}.csv")
        if os.path.exists(path):
            rows[name] = read_csv(path)
            os.remove(path)
    if failure:
        rows["correctness"].append(dict(variant=part, verdict=failure.replace("\n", " ")))
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="directory for the CSVs and gluon_check.md")
    p.add_argument("--variants", nargs="+", help="kernels_gluon.VARIANTS' names (default: all)")
    p.add_argument("--no-speed", action="store_true", help="correctness only")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds each variant's process may take")
    p.add_argument("--part", help=argparse.SUPPRESS)    # a child process's one variant (or the baselines)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (sm_90); CPU machines compile the kernels with "
                "python -m experiments.compile_gluon_sm90")
    variants = args.variants or list(kernels_gluon.VARIANTS)
    unknown = [v for v in variants if v not in kernels_gluon.VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(kernels_gluon.VARIANTS)}")
    os.makedirs(args.out, exist_ok=True)
    if args.part:   # a child: write this part's rows
        rows = dict(correctness=[] if args.part == BASELINES else correctness([args.part]),
                    sharp_rows=[] if args.part == BASELINES else sharp_rows(args.part),
                    speed=[] if args.no_speed else speed(args.part))
        columns = dict(correctness=CORRECTNESS_COLUMNS, sharp_rows=SHARP_COLUMNS, speed=SPEED_COLUMNS)
        for name in PARTS:
            with open(os.path.join(args.out, f"{name}_{args.part}.csv"), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=columns[name], extrasaction="ignore")
                w.writeheader()
                w.writerows(rows[name])
        return
    start = time.time()
    rows = {name: [] for name in PARTS}
    for part in ([] if args.no_speed else [BASELINES]) + variants:
        for name, got in run_part(part, args.out, args.timeout, args.no_speed).items():
            rows[name] += got
    header = (f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
              f"{time.time() - start:.0f} s")
    print(write(args.out, rows["correctness"], ratios(rows["speed"]), header, rows["sharp_rows"]))


if __name__ == "__main__":
    main()
