"""train.py with an experimental kernel variant: P 8x finer (p16), an fp64 lse (lse64), o32 in some rows, or the
"paper" mode with one group of roundings in fp32 (paper-s32, paper-acc32; see PATCHES).

    python results/commands/variants.py p16 /tmp/p16     # a copy of the checkout with kernels.py patched
    (cd /tmp/p16 && python -m nanolp.sweep --out $PWD/runs/x --arm p16="--fix off --lr 3e-3" --seeds 0)

Experiments, not features. lse64 (session 10, for session 11): the forward stores lse = m + log2(l) in fp64 and
the backward computes S - lse in fp64 before exp2, so that past logits of ~1.2e7, where fp32 drops a tie's
log2(l) and the backward recomputes P = 1 for each tied key, P stays exact ("fa2" only;
`python results/commands/variants_cpu.py`, results/variants_cpu_s10.txt). The question: does the default's final
loss blow-up, which always came after the max logit passed 1e8, need that limit?
o32-notsharp and o32-sharponly (session 10, run with `--fix off --delta-fp32`): delta reads the fp32 O only in
rows that are not sharp (largest P at most 1 - 1e-3), or only in sharp rows, and the bf16 O elsewhere; the
forward's O is unchanged (checked bit for bit, same script). The question: o32 cures the default; in which rows
does the error it removes start the growth? Session 10 found sharp rows only after the take-off.
p16 (issue 5, session 8): in "fa2", delta = rowsum(dO * O) differs from the exact
rowsum(dP * P) by two roundings: P's, before P V, inside O; and O's final cast to bf16.
  p16: P (and V) go into P V as fp16 instead of bf16: P's rounding 8x finer, O's cast unchanged.
       (V's bf16 values are exact in fp16 from 2^-14 to 65504; smaller ones lose bits.)
The other half, delta read from O before its cast with P's rounding unchanged, was the variant o32 here in
sessions 8-9; it is `--delta-fp32` (kernels.flash_attention(delta_fp32=True)) since, the same computation.
Checked on the CPU (Triton's interpreter, patched for bf16; 2 x 2 heads x 130 x 64, q scaled 3x, gradients
through an autocast linear as in model.py): p16 leaves O's cast-free error 8x smaller."""
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATCHES = {
    "p16": [("acc = tl.dot(_round_bits(p, P_BITS).to(q.dtype), v, acc)",
             "acc = tl.dot(p.to(tl.float16), v.to(tl.float16), acc)")],
    "lse64": [("lse = m_i + (tl.log(l_i) if PAPER else tl.math.log2(l_i))",
               "lse = m_i.to(tl.float64) + (tl.log(l_i) if PAPER else tl.math.log2(l_i)).to(tl.float64)"),
              ("    return tl.math.exp2(s - lse[:, None])",
               "    return tl.math.exp2((s.to(tl.float64) - lse[:, None]).to(tl.float32))"),
              ("lse = torch.empty((B, H, N), dtype=torch.float32, device=q.device)",
               "lse = torch.empty((B, H, N), dtype=torch.float64, device=q.device)"),
              ("return o, q.new_empty(q.shape[:3], dtype=torch.float32)",
               "return o, q.new_empty(q.shape[:3], dtype=torch.float64)"),
              ("delta = torch.empty_like(lse)", "delta = torch.empty_like(lse, dtype=torch.float32)")],
}
# The "paper" precision mode with one group of its rounding points taken back to fp32 (session 13, for session 14;
# run with --precision paper --fix off). The paper mode's layer 0 takes off by step 12,000 through delta (delta from
# P stops it, the fix does not); which of its roundings makes O's error grow it that much sooner than "fa2"?
#   paper-s32: scores S = Q K^T * scale kept in fp32 (forward and backward; session 4's question)
#   paper-acc32: P V and the accumulator in fp32 (P, l and m still rounded as in the paper mode); on random rows
#                it brings the error O puts into delta from ~1.6x fa2's down to fa2's (results/variants_cpu_s13.txt)
PATCHES.update({
    "paper-s32": [("s = s.to(q.dtype).to(tl.float32)", "s = s  # variant: scores kept in fp32"),
                  ("(s * qk_scale).to(q.dtype).to(tl.float32)", "s * qk_scale")],
    "paper-acc32": [("pv = tl.dot(p, v).to(q.dtype).to(tl.float32)", "pv = tl.dot(p, v)  # variant: fp32"),
                    ("acc = (acc * alpha[:, None]).to(q.dtype).to(tl.float32)", "acc = acc * alpha[:, None]"),
                    ("acc = (acc + pv).to(q.dtype).to(tl.float32)", "acc = acc + pv")],
})
# Session 14's paper-dpn (delta from P over rowsum(P) in the paper mode) is `--precision paper --delta-from-p`
# itself since session 15 (kernels.py); s15_paper_dpn.sh ran it from this file at commit 6a4296d.
# o32 split by row (run with --delta-fp32 --fix off): delta reads the fp32 O in some rows and the bf16 O in the
# others; a row is sharp when its largest P = 1/l (fix off, "fa2") exceeds 1 - 1e-3, as in diagnostics' sharp_rate.
STORE_O = "    o = _round_bits(acc / l_i[:, None], O_BITS)\n"
for name, bf16_rows in (("o32-notsharp", "l_i * (1 - 1e-3) < 1"), ("o32-sharponly", "l_i * (1 - 1e-3) >= 1")):
    PATCHES[name] = [(STORE_O, STORE_O + f"    o = tl.where(({bf16_rows})[:, None], o.to(q.dtype).to(tl.float32), o)"
                               "  # variant: delta reads the bf16 O in these rows\n")]


def patched_kernels(name):
    src = (ROOT / "kernels.py").read_text()
    for old, new in PATCHES[name]:
        assert src.count(old) == 1, f"kernels.py changed: update variant {name} ({old.strip()[:40]}...)"
        src = src.replace(old, new)
    # The ops get their own namespace: torch.compile's caches key a graph by the ops it calls, not by their fake
    # (shape and dtype) functions, so under a shared name a variant with an fp32 O reused a graph compiled for a
    # bf16 O and failed (session 8: "mat1 and mat2 must have the same dtype" in c_proj).
    assert src.count('"nanolp::') == 2, "kernels.py changed: update the namespace rename"
    return src.replace('"nanolp::', f'"nanolp_{name.replace("-", "_")}::')


if __name__ == "__main__":
    name, dest = sys.argv[1], Path(sys.argv[2])
    src = patched_kernels(name)   # first: a stale patch leaves no half-made copy behind
    dest.mkdir(parents=True, exist_ok=True)
    for f in ("model.py", "train.py"):
        shutil.copy(ROOT / f, dest / f)
    shutil.copytree(ROOT / "nanolp", dest / "nanolp", dirs_exist_ok=True)
    (dest / "kernels.py").write_text(src)
    if not (dest / "data").exists():
        (dest / "data").symlink_to(ROOT / "data")   # the same text and token cache
