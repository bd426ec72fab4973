"""CPU check of variants.py's lse64 (session 10): the backward's P from an fp64 lse, against the plain kernel.

    python results/commands/lse64_cpu.py      # ~10 s; output as in results/lse64_cpu_s10.txt

The plain kernel stores lse = m + log2(l) in fp32; past logits of ~1.2e7 (2^24 in log2 units) a tie's log2(l)
is lost, and the backward recomputes P = 1 for each tied key instead of 1/2. lse64 stores it in fp64 and
computes S - lse there. Checked: (1) the dV of two exactly tied keys (key 5 copied, value included, to key 9)
against float64 at logits 1e6, 1e8, 1e9; (2) on ordinary inputs lse64 stays within twice plain bf16 attention's
error against float64, as tests/test_kernels.py asks of the kernel."""
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
from tests.test_kernels import check_against_float64, rand, reference  # noqa: E402
from variants import patched_kernels  # noqa: E402


def load_lse64():
    path = Path(tempfile.mkdtemp()) / "kernels_lse64.py"
    path.write_text(patched_kernels("lse64"))
    spec = importlib.util.spec_from_file_location("kernels_lse64", path)
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


if __name__ == "__main__":
    lse64 = load_lse64()
    for logit in (1e6, 1e8, 1e9):
        print(f"logit {logit:g}: plain {tied_dv(kernels, logit)} | lse64 {tied_dv(lse64, logit)}")
    for seed, shape in enumerate([(2, 2, 130, 64), (1, 3, 77, 32), (1, 1, 200, 128)]):
        for scale in (1, 4):
            q, k, v = (rand(shape, seed=seed * 3 + i) for i in range(3))
            check_against_float64((q * scale).to(torch.bfloat16), k, v, True, attention=lse64.flash_attention)
    print("lse64: O, dQ, dK, dV within twice plain bf16 attention's error of float64 (3 shapes x 2 logit scales)")
