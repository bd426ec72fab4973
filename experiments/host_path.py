"""Where an eager forward+backward's time goes at short sequences: the host's Python path (custom ops, autograd,
Triton's launcher) against the GPU's kernels, for kernels.py's flash_attention (fix "on") and torch SDPA's flash
backend, at the benchmark's shapes (experiments/bench.py: 16k tokens x 2048 channels, bf16, causal).

    python -m experiments.host_path [--out DIR] [--seqs 256 1024] [--head-dims 64 128]   # GPU (experiments/README.md)

Per row: cpu_us, the host's microseconds per call (a loop of calls, not synchronised: the launches are
asynchronous, so the loop's time is the host's while the GPU's queue has room); gpu_us, the kernels' own time per
call (the profiler's sum of their durations); wall_ms, do_bench's median as bench.py times it. Where cpu_us is
above gpu_us the GPU waits for the host, and wall_ms follows the host. Rows:
    fwd+bwd             flash_attention(q, k, v).backward(do), as shipped: eager calls run the custom ops'
                        functions directly (kernels.direct)
    fwd+bwd, through the ops    the same through the custom ops' dispatch, as torch.compile calls them: what
                        the dispatch costs
    launch NAME         one kernel[grid](...) call of each kernel the fwd+bwd launches: Triton's launcher
    sdpa_flash fwd+bwd  torch's FA2 (C++ host path), the target
"""
import argparse
import csv
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import kernels
from experiments.bench import CHANNELS, TOKENS
from nanolp.runconfig import Parser

CALLS = 100


class Kept:
    """Stands in for a kernel: launches it and keeps the launch, so the launcher can be timed alone."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.launches.append((self.kernel.fn.__name__, self.kernel, grid, args, meta))
            return self.kernel[grid](*args, **meta)
        return launch


def kept_launches(fn):
    """The launches one call of fn makes: (name, kernel, grid, args, meta)."""
    names = ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
    saved = {name: getattr(kernels, name) for name in names}
    launches = []
    try:
        for name in names:
            setattr(kernels, name, Kept(saved[name], launches))
        fn()
    finally:
        for name, kernel in saved.items():
            setattr(kernels, name, kernel)
    return launches


class through_the_ops:
    """Inside the block, eager calls go through the custom ops' dispatch, as torch.compile's do."""

    def __enter__(self):
        self.direct, kernels.direct = kernels.direct, lambda op, fn: op

    def __exit__(self, *exc):
        kernels.direct = self.direct


def cpu_us(fn):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - start) / CALLS * 1e6
    torch.cuda.synchronize()
    return host


def gpu_us(fn, calls=20):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return sum(getattr(e, "self_device_time_total", 0) for e in events) / calls


def main(argv=None):
    p = Parser(prog="python -m experiments.host_path", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128], choices=sorted(kernels.FWD_TUNING))
    p.add_argument("--out", default="results/speed/host_path")
    args = p.parse_args(argv)
    if min(args.seqs) < 1:
        p.error(f"--seqs {min(args.seqs)}: a sequence length is at least 1")
    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU")
    rows = []
    for D in args.head_dims:
        for N in args.seqs:
            B, H = max(1, TOKENS // N), CHANNELS // D
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g)
                           for _ in range(4))
            q, k, v = (t.requires_grad_() for t in (q, k, v))

            def fresh(fn):   # each call's gradients new, as do_bench's grad_to_none leaves them (no accumulation)
                def call():
                    q.grad = k.grad = v.grad = None
                    fn()
                return call

            fwd_bwd = fresh(lambda: kernels.flash_attention(q, k, v, causal=True, fix="on").backward(do))

            def dispatched():
                with through_the_ops():
                    fwd_bwd()
            flash = fresh(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do))

            cases = [("fwd+bwd", fwd_bwd), ("fwd+bwd, through the ops", dispatched)]
            for name, kernel, grid, largs, meta in kept_launches(fwd_bwd):
                cases.append((f"launch {name}", lambda kernel=kernel, grid=grid, largs=largs, meta=meta:
                              kernel[grid](*largs, **meta)))
            cases.append(("sdpa_flash fwd+bwd", flash))
            for name, fn in cases:
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):     # entered once: its own cost is not the backend's
                    row = dict(head_dim=D, seq=N, batch=B, heads=H, case=name, cpu_us=cpu_us(fn), gpu_us=gpu_us(fn),
                               wall_ms=do_bench(fn, return_mode="median"))
                rows.append(row)
                print(f"D={D:<4}N={N:<6}{name:<28}cpu {row['cpu_us']:8.1f} us   gpu {row['gpu_us']:8.1f} us   "
                      f"wall {row['wall_ms'] * 1e3:8.1f} us", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "host_path.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
