"""kernels.py's dK/dV kernel (`_bwd_dkdv_kernel`, key-major: S^T = K Q^T and dP^T = V dO^T, so that dV += P^T dO
and dK += dS^T Q take their A operand as computed) compiled for the H200 (sm_90) on a machine without a GPU, at
kernels.py's settings (BWD_TUNING) and the one-pass backward's (experiments/launch_variants.py, ONE_PASS_TUNING;
its dK/dV program also adds dQ through fp32 atomics) and at the other tile shapes, warps and stages still
candidates; each one-pass row also with dQ added through TMA reductions instead (launch_variants.DQ_TMA, "TMA
dQ" rows: results/speed/backward_tma_dq.md). Prints a markdown table: registers, spills,
shared memory, programs per SM and the SASS of the loop over the query tiles.

    pip install --no-deps --target /tmp/triton36 triton==3.6.0      # the H200's triton
    PYTHONPATH=/tmp/triton36 python -m experiments.backward_variants   # CPU only, ~1 minute
    python -m experiments.backward_variants --time      # on the GPU: each variant's backward pass, timed

The launches are the benchmark's at seq 4096 (batch 4, 2048 channels, causal, fa2), as in sass.py, with the
block sizes, warps and stages of each row. Other tiles give other bits: a key's dK and dV are summed over query
tiles of BLOCK_M rows, the one-pass dQ over key tiles of BLOCK_N (nanolp/emulate.py follows kernels.py's tables).
results/speed/backward_onepass.md has this table with the rows of a query-major dK/dV kernel, the form
kernels.py's key-major one replaced.
"""
import torch
import triton

from experiments import sass  # first: it asserts no TRITON_INTERPRET
import kernels  # noqa: E402
from experiments.launch_variants import ONE_PASS_TUNING, one_pass_backward, tuned  # noqa: E402
from nanolp.runconfig import Parser  # noqa: E402

# The rows after kernels.py's own settings, all for the one-pass backward: head_dim: [(BLOCK_M queries,
# BLOCK_N keys, warps, stages), ...]
ONE_PASS_CANDIDATES = {
    64: [(64, 64, 4, 2), (64, 128, 8, 3), (32, 128, 8, 3), (32, 64, 4, 3)],
    128: [(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 8, 2), (32, 128, 8, 2), (32, 64, 4, 2)],
}
COLUMNS = ("HGMMA", "HMMA", "FADD", "FMUL", "MUFU.EX2", "F2F/F2FP", "BAR.SYNC", "WARPGROUP", "STS/LDS",
           "RED/ATOM", "STL/LDL")
# Loop columns of the TMA reduction beside sass.py's: the reduction itself (one in a thread's code; one elected
# lane in each of the first HEAD_DIM / 32 warps issues it, for a BLOCK_M x 32 fp32 box, 128 bytes wide, the
# shared-memory swizzle's width), and the proxy fence before it
TMA_COLUMNS = {"UTMAREDG": ("UTMAREDG",), "FENCE/MEMBAR": ("FENCE", "MEMBAR")}


def variants():
    """(label, head_dim, one pass, tuning, dQ by TMA) of each row: kernels.py's two settings per head_dim and
    the one-pass one with TMA dQ, then the candidates, each with atomics and with TMA dQ."""
    for D, candidates in ONE_PASS_CANDIDATES.items():
        yield "two-pass dK/dV (BWD_TUNING)", D, False, kernels.BWD_TUNING[D], False
        yield "one-pass (ONE_PASS_TUNING)", D, True, ONE_PASS_TUNING[D], False
        yield "one-pass, TMA dQ (ONE_PASS_TUNING)", D, True, ONE_PASS_TUNING[D], True
        for tuning in candidates:
            yield "one-pass", D, True, tuning, False
            yield "one-pass, TMA dQ", D, True, tuning, True


def backward(D, one_pass, tuning, tma):
    """The backward at head_dim D with a row's tiles, warps and stages and its dQ (TMA or atomics), as a function
    of (do, q, k, v, o, lse), so that the host builds the launch, the TMA descriptor's query tile included, as it
    would with these settings in place."""
    if one_pass:
        return lambda *tensors: one_pass_backward(*tensors, True, "fa2", False, True, tuning=tuning, tma=tma)

    def two_pass(*tensors):
        with tuned(bwd={D: tuning}):
            return kernels.flash_bwd_op(*tensors, True, "fa2", False, True)
    return two_pass


def launch(D, one_pass, tuning, tma):
    """The dK/dV launch the host makes at the benchmark's seq-4096 shape, with this row's settings."""
    q = torch.empty(sass.BATCH, sass.CHANNELS // D, sass.SEQ, D, dtype=torch.bfloat16)
    lse = torch.empty(q.shape[:3])
    _, dkdv, _ = sass.record(lambda: backward(D, one_pass, tuning, tma)(q, q, q, q, q, lse))
    return dkdv


def time_variants(seqs=(4096, 16384)):
    """Median ms of each variant's backward kernels on the GPU at the benchmark's shapes (16k tokens x 2048
    channels): the two-pass rows with the dQ kernel, the one-pass rows with zeroing the fp32 dQ buffer and
    its cast (TMA dQ rows: the buffer through its descriptor); delta's kernel, the same for all, left out. And
    each one-pass row's fp32 dQ buffer after its last run against the first one-pass row's (ONE_PASS_TUNING,
    atomics) on the same inputs: relative difference, per seq (the sums differ only in order and key tiles)."""
    from triton.testing import do_bench
    print("| variant | d | queries x keys | warps | stages | " + " | ".join(f"seq {n} ms" for n in seqs)
          + " | dQ buffer vs ONE_PASS_TUNING's |\n|" + "---|" * (6 + len(seqs)))
    references = {}
    for label, D, one_pass, tuning, tma in variants():
        block_m, block_n, warps, stages = tuning
        cells, checks = [label, D, f"{block_m} x {block_n}", warps, stages], []
        for N in seqs:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(16384 // N, 2048 // D, N, D, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
            o, lse, _ = kernels.forward(q, k, v, fix="off")
            run_backward = backward(D, one_pass, tuning, tma)
            delta, (kernel, args, meta), last = sass.record(lambda: run_backward(do, q, k, v, o, lse))
            grid = lambda block: (triton.cdiv(N, block), q.shape[0] * q.shape[1])  # noqa: E731
            delta[0][grid(delta[2]["BLOCK_M"])](*delta[1], **delta[2])             # delta, for real values
            dq_sum = getattr(args[8], "base", args[8])          # the one-pass's fp32 buffer (unused otherwise)

            def run():
                if one_pass:
                    dq_sum.zero_()
                kernel[grid(block_n)](*args, **meta)
                last[0][grid(last[2]["BLOCK_M"])](*last[1], **last[2])     # the dQ kernel, or dQ's cast
            cells.append(f"{do_bench(run, return_mode='median'):.3f}")
            if one_pass:
                reference = references.setdefault((D, N), dq_sum.clone())
                checks.append(f"{((dq_sum - reference).norm() / reference.norm()).item():.1e}")
        cells.append(" / ".join(checks) or "-")
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def main():
    p = Parser(prog="python -m experiments.backward_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--time", action="store_true", help="on a GPU: time each variant's backward pass instead")
    if p.parse_args().time:
        return time_variants()
    head = ["variant", "d", "queries x keys", "warps", "stages", "regs", "STL+LDL / stack", "smem KiB", "CTAs/SM",
            "loop", "loop warp-instr. per 64x64 pair", *COLUMNS, *TMA_COLUMNS]
    print(f"triton {triton.__version__}, sm_90; batch {sass.BATCH}, {sass.CHANNELS} channels, seq {sass.SEQ}, "
          "causal, fa2. Loop columns: SASS instructions in one iteration of the loop over the query tiles, per "
          "thread (RED/ATOM: REDG.E.ADD.F32x4, four fp32 adds each).\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for label, D, one_pass, tuning, tma in variants():
        block_m, block_n, warps, stages = tuning
        m = sass.measure(sass.compile_launch(*launch(D, one_pass, tuning, tma)))
        per_pair = m["loop"] * warps * 64 * 64 / (block_m * block_n)
        cells = [label, D, f"{block_m} x {block_n}", warps, stages, m["regs"], m["spills"], f"{m['smem_kib']:g}",
                 m["ctas"], m["loop"], f"{per_pair:.0f}", *(m["counts"][c] for c in COLUMNS),
                 *(sum(op.startswith(prefixes) for op in m["loop_opcodes"]) for prefixes in TMA_COLUMNS.values())]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
