"""train.py with kernels.py patched: the kernel variants behind the rows whose `variant` column names one here.

    python results/paper_precision/kernel_variants.py paper-s32 /tmp/s32      # a copy of the checkout, patched
    (cd /tmp/s32 && python train.py --precision paper --fix off --seed 0 --name paper-s32-s0)

Experiments, not features: each takes one rounding out of the kernel, or adds one back, to see which rounding a
run needs. NAME may join several with "+" (paper-s32+paper-undivided).
  lse-fp64         the forward stores lse = m + log2(l) in float64 and the backward computes S - lse there before
                   exp2. Past logits of ~1.2e7 (2^24 in log2 units) an fp32 lse loses a tie's log2(l), and the
                   backward recomputes P = 1 for each tied key instead of 1/2; in float64 P stays exact
                   (variant_checks.py). Does the default's final blow-up, always past a max logit of 1e8, need that?
  p16              P and V enter P V as fp16 instead of bf16: P's rounding 8x finer, O's final cast unchanged (V's
                   bf16 values are exact in fp16 from 2^-14 to 65504). The other half, delta read from O before its
                   cast with P's rounding unchanged, is --delta-fp32.
  paper-s32        in the "paper" precision, the scores S = Q K^T * scale kept in fp32 (forward and backward).
  paper-acc32      in the "paper" precision, P V and the accumulator in fp32 (P, l and m still rounded).
  paper-undivided  in the "paper" precision, delta from P (--delta-from-p) not divided by rowsum(P), whose bf16 l
                   leaves P summing to 1 + O(2^-9) (row_sums.py).
Each patch must match kernels.py exactly once; when kernels.py changes, the assertion names the patch to update.
"""
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = {
    "p16": [("acc = tl.dot(_round_bits(p, P_BITS).to(q.dtype), v, acc)",
             "acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)")],
    "lse-fp64": [("lse = m_i + (tl.log(l_i) if PAPER else tl.math.log2(l_i))",
                  "lse = m_i.to(tl.float64) + (tl.log(l_i) if PAPER else tl.math.log2(l_i)).to(tl.float64)"),
                 ("    return tl.math.exp2(s - lse[:, None])",
                  "    return tl.math.exp2((s.to(tl.float64) - lse[:, None]).to(tl.float32))"),
                 ("lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)",
                  "lse = torch.empty((B, H, N), dtype=torch.float64, device=q.device)"),
                 ("lse = q.new_empty(q.shape[:3], dtype=torch.float32)",
                  "lse = q.new_empty(q.shape[:3], dtype=torch.float64)"),
                 ("delta = torch.empty_like(lse)", "delta = torch.empty_like(lse, dtype=torch.float32)")],
    "paper-s32": [("s = s.to(q.dtype).to(tl.float32)", "s = s  # variant: scores kept in fp32"),
                  ("(s * qk_scale).to(q.dtype).to(tl.float32)", "s * qk_scale")],
    "paper-acc32": [("pv = tl.dot(p, v).to(q.dtype).to(tl.float32)", "pv = tl.dot(p, v)  # variant: fp32"),
                    ("acc = (acc * alpha[:, None]).to(q.dtype).to(tl.float32)", "acc = acc * alpha[:, None]"),
                    ("acc = (acc + pv).to(q.dtype).to(tl.float32)", "acc = acc + pv")],
    "paper-undivided": [("delta = delta / tl.where(rows < N, p_sum, 1.0)", "delta = delta  # variant: undivided")],
}


def patched_kernels(name):
    """kernels.py's source with the patches of `name` applied, its ops renamed into their own namespace."""
    src = (ROOT / "kernels.py").read_text()
    for part in name.split("+"):
        if part not in PATCHES:
            raise SystemExit(f"unknown variant {part!r}; the variants are {', '.join(PATCHES)}")
        for old, new in PATCHES[part]:
            assert src.count(old) == 1, f"kernels.py changed: update variant {part} ({old.strip()[:40]}...)"
            src = src.replace(old, new)
    # torch.compile's caches key a graph by the ops it calls, not by their fake (shape and dtype) functions: under
    # the plain kernel's op names a variant could be served a graph compiled for the plain kernel
    assert src.count('"nanolp::') == 2, "kernels.py changed: update the namespace rename"
    return src.replace('"nanolp::', f'"nanolp_{name.replace("-", "_").replace("+", "_")}::')


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    name, dest = sys.argv[1], Path(sys.argv[2])
    src = patched_kernels(name)   # first: a stale patch leaves no half-made copy behind
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("model.py", "train.py"):
        shutil.copy(ROOT / f, dest / f)
    shutil.copytree(ROOT / "nanolp", dest / "nanolp", dirs_exist_ok=True)
    (dest / "kernels.py").write_text(src)
    if not (dest / "data").exists():
        (dest / "data").symlink_to(ROOT / "data")   # the same text and token cache
