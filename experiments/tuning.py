"""The tuning grid behind kernels.py's FWD_TUNING / BWD_TUNING, and training step time per attention (on a GPU).

    python -m experiments.tuning --out DIR                  # the grid, then step times with the chosen table
    python -m experiments.tuning --skip-grid --modes reduce-overhead --out DIR

1. Tuning grid: forward alone and backward alone, fix off, bf16, causal, for each setting below, in the form of
   kernels.py's tables (forward: rows, warps, stages; backward: queries, keys, warps, stages), at the training
   shapes (default preset: batch 64, 6 heads, seq 256, head_dim 64; gpt2 preset: 16 x 12 x 1024) and benchmark
   shapes (16k tokens x 2048 channels). Median ms (triton.testing.do_bench) -> tuning_grid.csv.
2. Training step time: train.py's model and optimizer (default preset dims, bf16 autocast, torch.compile, fused
   AdamW) with our kernel (kernels.py's table, then the grid's best for the training shape) and torch SDPA
   (flash, cuDNN), one after another in this process: median over 10 blocks of 10 steps, one host sync per block
   as in train.py -> train_speed.csv, and a torch.profiler table of 5 steps per arm (GPU time by kernel) ->
   profiles.txt. --modes default reduce-overhead: also with torch.compile's CUDA graphs (train.py's default on a
   GPU), each mode's arms against SDPA flash in the same mode.
"""
import argparse
import csv
import statistics
import time
from pathlib import Path

import torch
from triton.testing import do_bench

import kernels
from experiments.launch_variants import tuned
from model import GPT, GPTConfig
from nanolp.runconfig import Parser

FWD_GRID = [(64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 8, 2), (128, 8, 3), (128, 8, 4)]
BWD_GRID = [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 8, 2), (128, 128, 8, 1), (128, 128, 8, 2)]
SHAPES = [(64, 6, 256, 64), (16, 12, 1024, 64), (16, 32, 1024, 64), (1, 32, 16384, 64), (16, 16, 1024, 128),
          (4, 16, 4096, 128)]


def grid(out):
    rows = []
    for B, H, N, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        for cfg in FWD_GRID:
            with tuned(fwd={D: cfg}):
                ms = do_bench(lambda: kernels.flash_attention(q, k, v, fix="off"), return_mode="median")
            rows.append(dict(B=B, H=H, N=N, D=D, part="fwd", cfg="/".join(map(str, cfg)), ms=ms))
        o = kernels.flash_attention(q, k, v, fix="off")
        for cfg in BWD_GRID:
            with tuned(bwd={D: cfg}):
                ms = do_bench(lambda: o.backward(do, retain_graph=True), return_mode="median",
                              grad_to_none=[q, k, v])
            rows.append(dict(B=B, H=H, N=N, D=D, part="bwd", cfg="/".join(map(str, cfg)), ms=ms))
        for part in ("fwd", "bwd"):
            mine = [r for r in rows if (r["N"], r["D"], r["H"], r["part"]) == (N, D, H, part)]
            print(f"{B}x{H}x{N}x{D} {part}: " + "  ".join(f"{r['cfg']} {r['ms']:.3f}" for r in mine), flush=True)
    with open(out / "tuning_grid.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    best = {}
    for part in ("fwd", "bwd"):
        mine = [r for r in rows if (r["N"], r["D"], r["part"]) == (256, 64, part)]
        best[part] = tuple(int(x) for x in min(mine, key=lambda r: r["ms"])["cfg"].split("/"))
    return best


def train_speed(attn, mode="default", steps=100, warmup=30, profile_to=None):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, attn=attn, fix="off")
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), fused=True)
    step_model = torch.compile(model, mode=mode)
    x = torch.randint(0, 65, (64, 256), device="cuda")
    y = torch.randint(0, 65, (64, 256), device="cuda")

    def step():
        torch.compiler.cudagraph_mark_step_begin()  # as train.py does
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = step_model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps // 10):  # as train.py: the host syncs once per 10 steps, so launches overlap the GPU
        t = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / 10)
    if profile_to:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        path, name = profile_to
        with open(path, "a") as f:
            f.write(f"== {name}\n{prof.key_averages().table(sort_by='cuda_time_total', row_limit=25)}\n")
    ms = statistics.median(times) * 1e3
    return ms, 64 * 256 / ms * 1e3


def main():
    p = Parser(prog="python -m experiments.tuning", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="out")
    p.add_argument("--skip-grid", action="store_true")
    p.add_argument("--modes", nargs="+", default=["default"], help="torch.compile modes to time",
                   choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    best = None if args.skip_grid else grid(out)
    rows = []
    arms = [("kernel", None), ("sdpa-flash", None), ("sdpa-cudnn", None)]
    if best:
        arms.insert(1, ("kernel", best))
    for mode in args.modes:
        for attn, tuning in arms:
            fwd, bwd = (tuning["fwd"], tuning["bwd"]) if tuning else (kernels.FWD_TUNING[64], kernels.BWD_TUNING[64])
            name = attn + ("-tuned" if tuning else "") + ("" if mode == "default" else "-" + mode)
            with tuned(fwd={64: fwd}, bwd={64: bwd}):
                ms, tps = train_speed(attn, mode, profile_to=(out / "profiles.txt", name))
            rows.append(dict(attn=name, mode=mode, fwd=fwd, bwd=bwd, step_ms=ms, tokens_per_s=tps))
            print(f"{name:<14} step {ms:.2f} ms  {tps / 1e6:.3f}M tokens/s", flush=True)
    for r in rows:  # against SDPA flash compiled in the same mode
        base = next(b for b in rows if b["mode"] == r["mode"] and b["attn"].startswith("sdpa-flash"))["step_ms"]
        r["vs_sdpa_flash"] = base / r["step_ms"]
        print(f"{r['attn']:<14} {r['vs_sdpa_flash']:.3f}x sdpa-flash")
    with open(out / "train_speed.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
