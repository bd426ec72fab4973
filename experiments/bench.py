"""Benchmark: our kernel (fix off, the fix, the paper's rule, delta from P; the first two also with
the one-pass backward, experiments/launch_variants.py) against torch SDPA's flash and cuDNN backends, side by
side in one run.

    python -m experiments.bench [--out results/speed/bench.csv] [--seqs 1024 4096 16384] [--head-dims 64 128]
    python -m experiments.bench --table results/speed/bench_h100.csv   # README's speed table, from the CSV (CPU)
    python -m experiments.bench --impls ours ours_fix sdpa_cudnn --repeats 5 --out results/speed/fix_cost.csv
    python -m experiments.bench --cost results/speed/fix_cost.csv  # the fix's cost over fix off, every shape (CPU)

--repeats R times every impl R times at each shape, in turn (impl 1, 2, ..., 1, 2, ...), so that a drift of the
GPU's clock falls on all of them alike; --cost then takes, per shape, the median over the repeats of the fix's time
over fix off's in the same round.

bf16, causal; batch x heads sized so every shape holds 16k tokens x 2048 channels (fills an H200); median of
repeated timings (triton.testing.do_bench); TFLOP/s count the causal half only (4 B H N^2 D / 2 forward,
2.5x that backward). Ratios are sdpa_cudnn's time over the impl's (> 1 means faster than cuDNN, torch's default
SDPA backend on the H200).
"""
import argparse
import csv
import math
import os
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from kernels import Numerics, flash_attention
from experiments.launch_variants import one_pass_attention
from nanolp.runconfig import Parser
from nanolp.runs import read_rows

TOKENS, CHANNELS = 16384, 2048


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return run


IMPLS = {
    "ours": lambda q, k, v: flash_attention(q, k, v, causal=True, fix="off"),
    # the fix: delta from the forward's fp32 O
    "ours_fix": lambda q, k, v: flash_attention(q, k, v, causal=True, fix="on"),
    # softmax's exponent as PyTorch builds FA2 (S * scale rounded, then the max subtracted), not one fma
    "ours_torch_exp": lambda q, k, v: flash_attention(q, k, v, causal=True, fix="off",
                                                      numerics=Numerics(exponent="torch")),
    # the paper's rule: a tied row max shifted up
    "ours_paper": lambda q, k, v: flash_attention(q, k, v, causal=True, fix="paper"),
    # the paper's control, delta = rowsum(dP * P): one more pass over the keys in the backward
    "ours_dp": lambda q, k, v: flash_attention(q, k, v, causal=True, fix="off", numerics=Numerics(delta="p")),
    # the one-pass backward: dQ through fp32 atomics in the dK/dV pass (5 matrix products per tile pair, not 7)
    "ours_1pass": lambda q, k, v: one_pass_attention(q, k, v, causal=True, fix="off"),
    "ours_fix_1pass": lambda q, k, v: one_pass_attention(q, k, v, causal=True, fix="on"),
    "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
}


def time_impl(fn, q, k, v, do):
    """Median milliseconds of forward, backward and forward+backward."""
    fwd = do_bench(lambda: fn(q, k, v), return_mode="median")
    o = fn(q, k, v)
    bwd = do_bench(lambda: o.backward(do, retain_graph=True), return_mode="median", grad_to_none=[q, k, v])
    both = do_bench(lambda: fn(q, k, v).backward(do), return_mode="median", grad_to_none=[q, k, v])
    return fwd, bwd, both


# README's speed table: forward+backward against cuDNN per head_dim, over the sequences where timings are steady
# (every one timed from 4k to 16k)
TABLE_IMPLS = {"ours": '`fix="off"`', "ours_fix": '`fix="on"`', "sdpa_flash": "torch SDPA flash"}
TABLE_SEQS = (4096, 16384)


def bench_rows(path, columns):
    """The rows of a bench CSV (nanolp.runs.read_rows), each of these columns as its number (impl as its text);
    ValueError, in one line naming the file, where it cannot be read, lacks one of these columns, a cell of them is
    no finite number (empty, or nan: an implementation not timed at that shape), or two rows time one implementation
    at one shape in one round (two benchmarks' CSVs joined, whose tables would mix them)."""
    rows = read_rows(path)
    missing = [c for c in columns if c not in rows[0]] if rows else []
    if missing:
        raise ValueError(f"{path} is not a bench CSV: no column {', '.join(missing)}")
    timed = set()
    for row in rows:
        key = tuple(row.get(c) for c in ("impl", "head_dim", "seq", "repeat"))
        if key in timed:
            raise ValueError(f"{path} has two rows of {key[0]} at head_dim {key[1]}, seq {key[2]}"
                             f"{f', round {key[3]}' if key[3] else ''}: one benchmark's CSV has one")
        timed.add(key)
        for column in (c for c in columns if c != "impl"):
            try:
                value = (int if column in ("head_dim", "seq") else float)(row[column])
            except ValueError:
                value = math.nan
            if not math.isfinite(value):
                raise ValueError(f"{path}: the row of {row.get('impl')} at head_dim {row.get('head_dim')}, seq "
                                 f"{row.get('seq')} has no {column} ({row[column]!r})")
            row[column] = value
    return rows


def speed_table(path):
    """The markdown lines of README's speed table, from a bench CSV: per head_dim, each implementation's range of
    fwd_bwd_vs_cudnn over the sequences from TABLE_SEQS's first to its last."""
    rows = [r for r in bench_rows(path, ("impl", "head_dim", "seq", "fwd_bwd_vs_cudnn"))
            if TABLE_SEQS[0] <= r["seq"] <= TABLE_SEQS[1]]
    span = lambda v: f"{min(v):.2f}x" if f"{min(v):.2f}" == f"{max(v):.2f}" else f"{min(v):.2f}-{max(v):.2f}x"
    seqs = "-".join(f"{n // 1024}k" for n in TABLE_SEQS)
    at = "seq " + " to ".join(map(str, TABLE_SEQS))
    if not rows:
        raise ValueError(f"{path} has no rows at {at}")
    lines = ["| head_dim, seq: speed over cuDNN's | " + " | ".join(TABLE_IMPLS.values()) + " |",
             "|---" * (len(TABLE_IMPLS) + 1) + "|"]
    for D in sorted({r["head_dim"] for r in rows}):
        ratios = {impl: [r["fwd_bwd_vs_cudnn"] for r in rows if r["impl"] == impl and r["head_dim"] == D]
                  for impl in TABLE_IMPLS}
        missing = [impl for impl, v in ratios.items() if not v]
        if missing:
            raise ValueError(f"{path} has no rows of {', '.join(missing)} at {at}, head_dim {D}")
        lines.append(f"| {D}, {seqs} | " + " | ".join(map(span, ratios.values())) + " |")
    return lines


def fix_ratios(path, column="fwd_bwd_ms"):
    """{(head_dim, seq): fix "on"'s time over fix "off"'s in the same round of timings, the median over the rounds
    of --repeats (a CSV without them is one round)}, from a bench CSV; column: fwd_ms, bwd_ms or fwd_bwd_ms.
    ValueError where there is no fix "on" timing, or one has no fix "off" timing beside it."""
    ms = {(r["impl"], r["head_dim"], r["seq"], int(r.get("repeat") or 0)): r[column]
          for r in bench_rows(path, ("impl", "head_dim", "seq", column))}
    fix = [key[1:] for key in ms if key[0] == "ours_fix"]
    if not fix:
        raise ValueError(f"{path} has no rows of ours_fix")
    alone = [(d, n) for d, n, r in fix if ("ours", d, n, r) not in ms]
    if alone:
        raise ValueError(f"{path} has no row of ours beside ours_fix's at head_dim {alone[0][0]}, seq {alone[0][1]}")
    return {(D, N): statistics.median(ms["ours_fix", d, n, r] / ms["ours", d, n, r] for d, n, r in fix
                                      if (d, n) == (D, N)) for D, N, _ in fix}


def fix_cost_table(path):
    """The markdown lines of the fix's cost: fix_ratios' forward+backward, minus 1, in per cent, per head_dim (rows)
    and sequence length (columns), from a bench CSV."""
    cost = fix_ratios(path)
    seqs = sorted({N for _, N in cost})
    lines = ["| head_dim | " + " | ".join(f"{N:,}" for N in seqs) + " |", "|---" * (len(seqs) + 1) + "|"]
    for D in sorted({D for D, _ in cost}):
        lines.append(f"| {D} | " + " | ".join(f"{100 * (cost[D, N] - 1):+.1f}%" for N in seqs) + " |")
    return lines


def measure(impls, head_dims, seqs, repeats):
    """One row per impl, shape and round of timings that ran: times, TFLOP/s and their ratios to sdpa_cudnn's."""
    rows = []
    for D in head_dims:
        for N in seqs:
            B, H = max(1, TOKENS // N), CHANNELS // D
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))
            flops_fwd = 4 * B * H * N * N * D / 2
            for repeat in range(repeats):
                for name in impls:
                    try:
                        ms = time_impl(IMPLS[name], q, k, v, do)
                    except RuntimeError as e:   # e.g. a backend that does not support this shape
                        print(f"{name} D={D} N={N}: {e}".splitlines()[0])
                        continue
                    tflops = [f / t * 1e-9 for f, t in zip((flops_fwd, 2.5 * flops_fwd, 3.5 * flops_fwd), ms)]
                    rows.append(dict(impl=name, head_dim=D, seq=N, repeat=repeat, batch=B, heads=H, fwd_ms=ms[0],
                                     bwd_ms=ms[1], fwd_bwd_ms=ms[2], fwd_tflops=tflops[0], bwd_tflops=tflops[1],
                                     fwd_bwd_tflops=tflops[2]))
    base = {(r["head_dim"], r["seq"], r["repeat"]): r for r in rows if r["impl"] == "sdpa_cudnn"}
    for r in rows:
        b = base.get((r["head_dim"], r["seq"], r["repeat"]))
        for key in ("fwd", "bwd", "fwd_bwd"):
            r[f"{key}_vs_cudnn"] = b[f"{key}_ms"] / r[f"{key}_ms"] if b else float("nan")
    return rows


def main(argv=None):
    p = Parser(prog="python -m experiments.bench", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--out", default="results/speed/bench.csv")
    p.add_argument("--impls", nargs="+", choices=list(IMPLS), default=list(IMPLS), help="the implementations timed")
    p.add_argument("--repeats", type=int, default=1, help="rounds of timings of every impl at each shape, in turn")
    p.add_argument("--table", metavar="CSV", help="print README's speed table from a bench CSV instead of timing")
    p.add_argument("--cost", metavar="CSV", help="print the fix's cost over fix off from a bench CSV instead of timing")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be 1 or more")
    if min(args.seqs + args.head_dims) < 1:
        p.error("--seqs and --head-dims must be 1 or more")
    if args.table and args.cost:
        p.error("--table and --cost: give one of them (each prints its own table)")
    if args.table or args.cost:
        path = args.table or args.cost
        try:
            print("\n".join(speed_table(path) if args.table else fix_cost_table(path)))
        except (OSError, ValueError) as e:   # (the CSV it cannot read, or the rows it lacks)
            p.error(str(e))
        return
    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU; --table and --cost read a bench CSV on the CPU")
    if os.path.isdir(args.out):   # (found before the timings, not after)
        p.error(f"--out must be a file: {args.out} is a folder")
    rows = measure(args.impls, args.head_dims, args.seqs, args.repeats)
    if not rows:   # (before --out is opened: a committed CSV is not replaced by nothing)
        p.error(f"no implementation ran at any shape: {args.out} left as it was")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'impl':<15}{'D':>4}{'N':>7}{'fwd TF/s':>10}{'bwd TF/s':>10}{'f+b TF/s':>10}{'fwd x':>8}{'f+b x':>8}")
    for r in rows:
        print(f"{r['impl']:<15}{r['head_dim']:>4}{r['seq']:>7}{r['fwd_tflops']:>10.0f}{r['bwd_tflops']:>10.0f}"
              f"{r['fwd_bwd_tflops']:>10.0f}{r['fwd_vs_cudnn']:>8.2f}{r['fwd_bwd_vs_cudnn']:>8.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
