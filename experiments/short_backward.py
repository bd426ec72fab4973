"""The single-pass backward for short sequences (experiments/launch_variants.py, single_pass_attention: the whole
backward of a (batch, head) in one program, one launch) compiled for the H200 (sm_90) on a machine without a GPU,
beside kernels.py's two-pass backward at the same length; with --time, both timed on the GPU.

    pip install --no-deps --target /tmp/triton36 triton==3.6.0       # the H200's triton
    PYTHONPATH=/tmp/triton36 python -m experiments.short_backward    # CPU only, ~1 minute: results/speed/short_backward.md
    python -m experiments.short_backward --time                      # on the GPU

The launches are the benchmark's at seq 256 (python -m experiments.bench: 16k tokens x 2048 channels, batch 64,
causal, fa2), recorded from the host code and compiled as the GPU's JIT specializes them (experiments/sass.py).
The two-pass rows are kernels.py's dK/dV and dQ kernels; the single-pass rows are SINGLE_PASS_TUNING's setting
and the other warps and stages of CANDIDATES (the tiles stay kernels.BWD_TUNING's: other tiles, other bits).
"""
import sys

import torch

from experiments import sass  # first: it asserts no TRITON_INTERPRET
import kernels  # noqa: E402
from experiments.bench import CHANNELS, TOKENS  # noqa: E402
from experiments.launch_variants import SINGLE_PASS_TUNING, single_pass_backward  # noqa: E402

SEQ = 256
# (warps, stages) compiled beside SINGLE_PASS_TUNING's, per head_dim
CANDIDATES = {64: [(4, 2), (8, 1)], 128: [(4, 1), (8, 2)]}
COLUMNS = ("HGMMA", "FADD", "FMUL", "MUFU.EX2", "BAR.SYNC", "WARPGROUP", "STS/LDS", "STL/LDL")


def tunings(D):
    """SINGLE_PASS_TUNING's setting at head_dim D, then the candidates', with its tiles."""
    block_m, block_n = SINGLE_PASS_TUNING[D][:2]
    return [SINGLE_PASS_TUNING[D]] + [(block_m, block_n, warps, stages) for warps, stages in CANDIDATES[D]]


def inputs(D, N, device="cpu"):
    """The benchmark's (batch, heads) at this length: q, k, v, do (random on a GPU; unused on the CPU)."""
    shape = (TOKENS // N, CHANNELS // D, N, D)
    if device == "cpu":
        return [torch.empty(shape, dtype=torch.bfloat16)] * 4
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g) for _ in range(4)]


def rows(D):
    """(label, tuning, compiled measure) of the two-pass backward's dK/dV and dQ kernels and of each single-pass
    setting at head_dim D."""
    q, _, _, _ = inputs(D, SEQ)
    lse = torch.empty(q.shape[:3])
    _, dkdv, dq = sass.record(lambda: kernels.flash_bwd_op(q, q, q, q, q, lse, True, "fa2", False, True))
    two_pass = (*kernels.BWD_TUNING[D][:3], 1)     # one stage: kernels.bwd_launch's up to SHORT_SEQ keys
    out = [(f"two-pass {name}", two_pass, sass.measure(sass.compile_launch(*launch)))
           for name, launch in (("dK/dV", dkdv), ("dQ", dq))]
    for tuning in tunings(D):
        (launch,) = sass.record(lambda: single_pass_backward(q, q, q, q, q, lse, True, "fa2", False, True, tuning))
        label = "single-pass (SINGLE_PASS_TUNING)" if tuning == SINGLE_PASS_TUNING[D] else "single-pass"
        out.append((label, tuning, sass.measure(sass.compile_launch(*launch))))
    return out


def time_backwards(seqs=(256, 512)):
    """Median ms of the backward as autograd calls it (host included: the launches, the allocations) at the
    benchmark's shapes: kernels.flash_bwd (three launches, as an eager call runs them) and single_pass_backward at each setting (one), and
    whether the single-pass gradients equal the two-pass ones bit for bit on this GPU."""
    from triton.testing import do_bench
    print("| backward | d | warps | stages | " + " | ".join(f"seq {n} ms" for n in seqs)
          + " | bitwise equal to two-pass (dQ, dK, dV) |\n|" + "---|" * (5 + len(seqs)))
    for D in (64, 128):
        cells = {None: ["two-pass (kernels.py)", D, *kernels.BWD_TUNING[D][2:3], 1]}
        cells.update({tuning: ["single-pass", D, *tuning[2:]] for tuning in tunings(D)})
        equal = {tuning: [] for tuning in tunings(D)}
        for N in seqs:
            q, k, v, do = inputs(D, N, "cuda")
            o, lse, _ = kernels.forward(q, k, v, fix="off")
            args = (do, q, k, v, o, lse, True, "fa2", False, True)
            two = kernels.flash_bwd(*args)
            cells[None].append(f"{do_bench(lambda: kernels.flash_bwd(*args), return_mode='median'):.3f}")
            for tuning in tunings(D):
                cells[tuning].append(f"{do_bench(lambda: single_pass_backward(*args, tuning), return_mode='median'):.3f}")
                one = single_pass_backward(*args, tuning)
                equal[tuning].append("/".join("yes" if torch.equal(a, b) else "no" for a, b in zip(one, two)))
        for key, row in cells.items():
            row.append(" ; ".join(equal[key]) if key else "-")
            print("| " + " | ".join(map(str, row)) + " |", flush=True)


def main():
    if "--time" in sys.argv[1:]:
        return time_backwards()
    head = ["backward", "d", "queries x keys", "warps", "stages", "regs", "STL+LDL / stack", "smem KiB", "CTAs/SM",
            "loop", "loop warp-instr.", *COLUMNS]
    print(f"sm_90; batch {TOKENS // SEQ}, {CHANNELS} channels, seq {SEQ}, causal, fa2. Loop: SASS "
          "instructions per thread in one iteration of the loop over the query tiles (the single-pass kernel's "
          "inner loop: one (query tile, key tile) pair); loop warp-instr.: loop x warps, the pair's cost across warp "
          "counts (the two-pass backward's is its two kernels' sum).\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for D in (64, 128):
        for label, (block_m, block_n, warps, stages), m in rows(D):
            cells = [label, D, f"{block_m} x {block_n}", warps, stages, m["regs"], m["spills"], f"{m['smem_kib']:g}",
                     m["ctas"], m["loop"], m["loop"] * warps, *(m["counts"][c] for c in COLUMNS)]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
