"""Issue 6 experiment (session 4): what in the fix costs forward time. Builds variants of kernels.py by patching its
source text (nothing here is library code), then times the forward alone, median of do_bench, bf16, causal, 16k
tokens x 2048 channels as in nanolp.bench.    python results/commands/fix_cost.py [--out fix_cost.csv]"""
import argparse
import csv
import importlib.util
import os
import sys
import tempfile

import torch
from triton.testing import do_bench

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
SRC = open(os.path.join(ROOT, "kernels.py")).read()
FOLD = "    d = tl.where((d >= lo) & (d < hi), d, lo + d % span)\n"
COUNT = "    n_near = tl.sum((s >= (r - tol)[:, None]).to(tl.int32), 1)\n"
ACROSS = "    across = (r >= t - tol) & (t >= r - tol)\n"
VARIANTS = {  # name: (fix, [(old, new), ...])
    "off": (False, []),
    "fix": (True, []),
    "fold_floor": (True, [(FOLD, "    d = tl.where((d >= lo) & (d < hi), d, lo + d - span * tl.floor(d * (1.0 / span)))\n")]),
    "no_fold": (True, [(FOLD, "")]),
    "count_f32": (True, [(COUNT, COUNT.replace("tl.int32", "tl.float32"))]),
    "per_tile_only": (True, [(ACROSS, "    across = r != r\n")]),
    "no_count": (True, [(COUNT, "    n_near = r.to(tl.int32) * 0\n")]),
}


def load(name, edits):
    src = SRC.replace("nanolp::", f"nanolp_{name}::")
    for old, new in edits:
        assert old in src, (name, old)
        src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"kernels_{name}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"kernels_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="fix_cost.csv")
    args = p.parse_args()
    rows = []
    mods = {name: (fix, load(name, edits)) for name, (fix, edits) in VARIANTS.items()}
    for D in (64, 128):
        for N in (4096, 16384):
            B, H = max(1, 16384 // N), 2048 // D
            q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            for name, (fix, mod) in mods.items():
                ms = do_bench(lambda: mod.flash_attention(q, k, v, causal=True, fix=fix), return_mode="median")
                rows.append(dict(variant=name, head_dim=D, seq=N, fwd_ms=ms))
            off = rows[-len(mods)]["fwd_ms"]
            for r in rows[-len(mods):]:
                r["vs_off"] = off / r["fwd_ms"]
                print(f"{r['variant']:<14}{D:>4}{N:>7}{r['fwd_ms']:>9.3f} ms{r['vs_off']:>7.2f}x", flush=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
