"""CPU checks of variants.py's lse64, o32 row splits (session 10) and paper-mode variants (session 13), on Triton's
interpreter patched for bf16.

    python results/commands/variants_cpu.py      # ~40 s; output as in results/variants_cpu_s13.txt

lse64. The plain kernel stores lse = m + log2(l) in fp32; past logits of ~1.2e7 (2^24 in log2 units) a tie's
log2(l) is lost, and the backward recomputes P = 1 for each tied key instead of 1/2. lse64 stores it in fp64 and
computes S - lse there. Checked: (1) the dV of two exactly tied keys (key 5 copied, value included, to key 9)
against float64 at logits 1e6, 1e8, 1e9; (2) on ordinary inputs lse64 stays within twice plain bf16 attention's
error against float64, as tests/test_kernels.py asks of the kernel.

paper-s32 / paper-acc32 (session 13; "paper" precision, each with one group of roundings in fp32).
Each must change the paper mode's O (else the patch missed) and bring O closer to float64, and its O, dQ, dK, dV
must stay within twice plain bf16 attention's error, on rows with logits from soft to ~40. Then the rms of the
error O brings into delta (rowsum(dO * O) less the rowsum(dP * P) of --delta-from-p) for each arm of
s14_paper_variants.sh, with fa2 and the plain paper mode beside them. (A third variant, S - m' in fp32 before exp,
changed nothing measurable: S and m' are both bf16, and their difference mostly is too.) Last, how much more often
the top two scores of a row tie once the scores are rounded to bf16, as in the paper mode.

o32-notsharp / o32-sharponly (with delta_fp32=True). Row i of dQ depends on row i's delta alone, so each row of
dQ must equal, bit for bit, --delta-fp32's where delta reads the fp32 O and the plain kernel's where it reads the
bf16 O; and the forward's O must be the plain kernel's. Checked on rows of which some are sharp (largest P above
1 - 1e-3) and some not, counting the rows where the plain kernel and --delta-fp32 differ (else the check is void).
"""
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "results" / "commands"))
from tests import conftest  # noqa: E402,F401  (TRITON_INTERPRET and the bf16 patch of the interpreter)
import kernels  # noqa: E402
from tests.test_kernels import check_against_float64, rand, reference, rel  # noqa: E402
from variants import patched_kernels  # noqa: E402


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


def split_rows(name, module):
    """dQ row by row against the plain kernel and --delta-fp32; returns a line of counts, asserts the bits."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (rand((2, 2, 192, 64), seed=70 + i) for i in range(3))
    q = (q.float() * (torch.rand(2, 2, 192, 1, generator=g) * 12)).to(torch.bfloat16)  # rows from soft to sharp
    do = rand(q.shape, seed=73)
    grads, outs = {}, {}
    for label, attention, kw in (("plain", kernels, {}), ("fp32 O", kernels, dict(delta_fp32=True)),
                                 (name, module, dict(delta_fp32=True))):
        qq = q.clone().requires_grad_()
        o = attention.flash_attention(qq, k, v, causal=True, **kw)
        o.backward(do)
        grads[label], outs[label] = qq.grad, o
    assert torch.equal(outs[name], outs["plain"]), "the variant's forward O differs from the plain kernel's"
    S = (q.double() @ k.double().transpose(-1, -2)) / 8
    S = S.masked_fill(torch.ones(192, 192, dtype=torch.bool).triu(1), -torch.inf)
    sharp = torch.softmax(S, -1).amax(-1) > 1 - 1e-3
    fp32_rows = ~sharp if name == "o32-notsharp" else sharp
    same = lambda a, b: (grads[a] == grads[b]).all(-1)
    assert same(name, "fp32 O")[fp32_rows].all() and same(name, "plain")[~fp32_rows].all()
    differ = ~same("plain", "fp32 O")
    return (f"{name}: {int(sharp.sum())} sharp rows of {sharp.numel()}; plain and --delta-fp32 dQ differ in "
            f"{int((differ & sharp).sum())} sharp and {int((differ & ~sharp).sum())} other rows; every dQ row equals "
            f"--delta-fp32's where delta reads the fp32 O and the plain kernel's elsewhere; O equals the plain one")


def delta_error(module, q, k, v, do, fp32_o=False, precision="paper"):
    """delta = rowsum(dO * O) as the backward computes it, less rowsum(dP * P) from the backward's own P (what
    --delta-from-p computes): the error the forward's O brings into dS, all rows flattened."""
    o, lse = module._flash_fwd(q, k, v, True, False, precision, 2.0, module.TIE_TOL, False, fp32_o, 0, "p")
    launch = module._bwd_launch(q, k, v, o, True, precision)
    from_o, from_p = (module._bwd_delta(do, q, k, v, o, lse, launch, p) for p in (False, True))
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
            errors[label].append(rel(attention.flash_attention(q, k, v, causal=True, precision="paper"), ref))
        assert errors[name][-1] != errors["paper"][-1], f"{name} left the paper mode's O unchanged"
        check_against_float64(q, k, v, True, precision="paper", attention=module.flash_attention)
    assert sum(errors[name]) <= sum(errors["paper"]), f"{name}: O further from float64 than the paper mode's"
    return (f"{name}: O's error against float64 {', '.join(f'{e:.2e}' for e in errors[name])} (paper mode "
            f"{', '.join(f'{e:.2e}' for e in errors['paper'])}); O, dQ, dK, dV within twice plain bf16's")


if __name__ == "__main__":
    lse64 = load_variant("lse64")
    for logit in (1e6, 1e8, 1e9):
        print(f"logit {logit:g}: plain {tied_dv(kernels, logit)} | lse64 {tied_dv(lse64, logit)}")
    for seed, shape in enumerate([(2, 2, 130, 64), (1, 3, 77, 32), (1, 1, 200, 128)]):
        for scale in (1, 4):
            q, k, v = (rand(shape, seed=seed * 3 + i) for i in range(3))
            check_against_float64((q * scale).to(torch.bfloat16), k, v, True, attention=lse64.flash_attention)
    print("lse64: O, dQ, dK, dV within twice plain bf16 attention's error of float64 (3 shapes x 2 logit scales)")
    for name in ("o32-notsharp", "o32-sharponly"):
        print(split_rows(name, load_variant(name)))
    modules = {name: load_variant(name) for name in ("paper-s32", "paper-acc32")}
    for name, module in modules.items():
        print(paper_variant(name, module))
    print("rms of delta's error (rowsum(dO * O) less rowsum(dP * P)), 3 x 2 heads x 256 rows, q scaled by 1 / 3 / 8:")
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
