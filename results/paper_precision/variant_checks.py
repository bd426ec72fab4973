"""CPU checks of kernel_variants.py's patched kernels, on Triton's interpreter patched for bf16 (~2 minutes).

    python results/paper_precision/variant_checks.py > results/paper_precision/variant_checks.txt

lse-fp64. The plain kernel stores lse = m + log2(l) in fp32; past logits of ~1.2e7 (2^24 in log2 units) a tie's
log2(l) is lost, and the backward recomputes P = 1 for each tied key instead of 1/2. lse-fp64 stores it in float64
and computes S - lse there. Checked: (1) the dV of two exactly tied keys (key 5 copied, value included, to key 9)
against float64 at logits 1e6, 1e8, 1e9; (2) on ordinary inputs lse-fp64 stays within twice plain bf16 attention's
error against float64, as tests/test_kernels.py asks of the kernel.

paper-s32 / paper-acc32 ("paper" precision, each with one group of roundings in fp32). Each must change the paper
mode's O (else the patch missed) and bring O closer to float64, and its O, dQ, dK, dV must stay within twice plain
bf16 attention's error, on rows with logits from soft to ~40. Then the rms of the error O brings into delta
(rowsum(dO * O) less --delta-from-p's rowsum(dP * P), which the paper precision divides by rowsum(P)) for each arm
of rounding_variants.csv, with fa2 and the plain paper mode beside them. (A variant with S - m' in fp32 before exp
changes nothing measurable: S and m' are both bf16, and their difference mostly is too.) Last, how much more often
the top two scores of a row tie once the scores are rounded to bf16, as in the paper mode.
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from tests import conftest  # noqa: E402,F401  (TRITON_INTERPRET and the bf16 patch of the interpreter)
import kernels  # noqa: E402
from tests.test_kernels import check_against_float64, rand, reference, rel  # noqa: E402
from kernel_variants import patched_kernels  # noqa: E402

PAPER = kernels.Numerics(precision="paper")


def load_variant(name):
    path = Path(tempfile.mkdtemp()) / f"kernels_{name.replace('-', '_')}.py"
    path.write_text(patched_kernels(name))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tied_dv(module, logit):
    q, k, v = (rand((1, 2, 128, 64), seed=40 + i) for i in range(3))
    q = (q.float() * (logit / (q.float() @ k.float().transpose(-1, -2) / 8).amax())).to(torch.bfloat16)
    k[:, :, 9], v[:, :, 9] = k[:, :, 5], v[:, :, 5]
    do = rand(q.shape, seed=43)
    ref, ref_inputs = reference(q, k, v, True)
    ref.backward(do.double())
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    module.flash_attention(*inputs, causal=True).backward(do)
    ratio = [(inputs[2].grad[0, :, j].double().norm() / ref_inputs[2].grad[0, :, j].norm()).item() for j in (5, 9)]
    finite = all(torch.isfinite(t.grad).all().item() for t in inputs)
    return f"dV of keys 5, 9 / exact {ratio[0]:.4f} {ratio[1]:.4f}, finite {finite}"


def delta_error(module, q, k, v, do, fp32_o=False, precision="paper"):
    """delta = rowsum(dO * O) as the backward computes it, less rowsum(dP * P) from the backward's own P (what
    --delta-from-p computes): the error the forward's O brings into dS, all rows flattened."""
    o, lse, o32 = module._flash_fwd(q, k, v, True, False, "fp32 O" if fp32_o else "O", precision, 0, 0, False)
    o_delta = o32 if fp32_o else o   # the O that delta reads
    launch = module._bwd_launch(q, k, v, o_delta, True, precision)
    from_o, from_p = (module._bwd_delta(do, q, k, v, o_delta, lse, launch, p) for p in (False, True))
    return (from_o.double() - from_p.double()).flatten()


def paper_variant(name, module):
    """O error against float64 of the plain "paper" mode and of the variant; asserts the variant changed O and did
    not make it worse, and the float64 bounds for O and the gradients."""
    errors = {"paper": [], name: []}
    for seed, shape in enumerate([(2, 2, 130, 64), (1, 3, 200, 64)]):
        q, k, v = (rand(shape, seed=90 + seed * 3 + i) for i in range(3))
        q = (q.float() * torch.linspace(1, 8, shape[2])[:, None]).to(torch.bfloat16)  # rows from soft to sharp
        ref, _ = reference(q, k, v, True)
        for label, attention in (("paper", kernels), (name, module)):
            errors[label].append(rel(attention.flash_attention(q, k, v, causal=True, numerics=PAPER), ref))
        assert errors[name][-1] != errors["paper"][-1], f"{name} left the paper mode's O unchanged"
        check_against_float64(q, k, v, True, PAPER, attention=module.flash_attention)
    assert sum(errors[name]) <= sum(errors["paper"]), f"{name}: O further from float64 than the paper mode's"
    return (f"{name}: O's error against float64 {', '.join(f'{e:.2e}' for e in errors[name])} (paper mode "
            f"{', '.join(f'{e:.2e}' for e in errors['paper'])}); O, dQ, dK, dV within twice plain bf16's")


if __name__ == "__main__":
    lse_fp64 = load_variant("lse-fp64")
    for logit in (1e6, 1e8, 1e9):
        print(f"logit {logit:g}: plain {tied_dv(kernels, logit)} | lse-fp64 {tied_dv(lse_fp64, logit)}")
    for seed, shape in enumerate([(2, 2, 130, 64), (1, 3, 77, 32), (1, 1, 200, 128)]):
        for scale in (1, 4):
            q, k, v = (rand(shape, seed=seed * 3 + i) for i in range(3))
            check_against_float64((q * scale).to(torch.bfloat16), k, v, True, attention=lse_fp64.flash_attention)
    print("lse-fp64: O, dQ, dK, dV within twice plain bf16 attention's error of float64 (3 shapes x 2 logit scales)")
    modules = {name: load_variant(name) for name in ("paper-s32", "paper-acc32")}
    for name, module in modules.items():
        print(paper_variant(name, module))
    print("rms of delta's error (rowsum(dO * O) less --delta-from-p's delta), 3 x 2 heads x 256 rows, "
          "q scaled by 1 / 3 / 8:")
    arms = {"fa2": (kernels, False, "fa2"), "paper": (kernels, False, "paper"),
            "paper --delta-fp32": (kernels, True, "paper"), "paper-s32": (modules["paper-s32"], False, "paper"),
            "paper-acc32": (modules["paper-acc32"], False, "paper"),
            "paper-acc32 --delta-fp32": (modules["paper-acc32"], True, "paper")}
    for arm, (module, fp32_o, precision) in arms.items():
        rms = []
        for scale in (1, 3, 8):
            inputs = [[rand((1, 2, 256, 64), seed=200 + 10 * seed + i) for i in range(4)] for seed in range(3)]
            errors = [delta_error(module, (q.float() * scale).to(torch.bfloat16), k, v, do, fp32_o, precision)
                      for q, k, v, do in inputs]
            rms.append(torch.cat(errors).pow(2).mean().sqrt().item())
        print(f"  {arm:25s} " + " / ".join(f"{r:.2e}" for r in rms))
    print("rows whose top two scores tie (within TIE_TOL), 4,000 causal rows of up to 256 N(0, std) scores:")
    g = torch.Generator().manual_seed(0)
    for std in (1, 3, 5, 10):
        S = torch.randn(4000, 256, generator=g) * std
        S = S.masked_fill(torch.arange(256) >= torch.randint(1, 257, (4000, 1), generator=g), -torch.inf)
        tied = {p: (S_p >= S_p.amax(-1, keepdim=True) - kernels.TIE_TOL).sum(-1).ge(2).float().mean().item()
                for p, S_p in (("fp32", S), ("bf16", S.bfloat16().float()))}
        print(f"  std {std:2d} (max ~{S.amax(-1).median():4.1f}): fp32 scores {tied['fp32']:.4f}, "
              f"rounded to bf16 {tied['bf16']:.4f}")
