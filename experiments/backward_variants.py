"""The backward's candidate forms compiled for the H200 (sm_90) on a machine without a GPU: kernels.py's
two-pass backward (deterministic=True) and one-pass backward (deterministic=False, dQ through fp32 atomics),
and a key-major ("transposed") dK/dV kernel defined here, which computes S^T = K Q^T and dP^T = V dO^T so that
dV += P^T dO and dK += dS^T Q take their A operand as computed, at other tile shapes. Prints
results/speed/backward_onepass.md's table.

    pip install --no-deps --target /tmp/triton36 triton==3.6.0      # the H200's triton
    PYTHONPATH=/tmp/triton36 python -m experiments.backward_variants   # CPU only, ~1 minute
    python -m experiments.backward_variants --time      # on the GPU: each variant's backward pass, timed

The launches are the benchmark's at seq 4096 (batch 4, 2048 channels, causal, fa2), as in sass.py, with the
block sizes, warps and stages of each row. The key-major kernel is a compile study, not part of kernels.py;
under Triton's CPU interpreter it gives kernels.py's one-pass dK, dV and dQ sum bit for bit at 64 x 64 tiles
(checked by hand at 130 and 200 tokens, both precisions); with 32-row query steps its dK and dV are summed
over 32-row tiles, another order.
"""
import sys

import torch
import triton
import triton.language as tl

from experiments import sass  # first: it asserts no TRITON_INTERPRET
import kernels  # noqa: E402
from kernels import _scores  # noqa: E402


@triton.jit
def _bwd_dkdv_keymajor_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ,
                              stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
                              stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om, H, N,
                              qk_scale, sm_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PAPER: tl.constexpr,
                              ONE_PASS: tl.constexpr):
    # kernels._bwd_dkdv_kernel with the key tile as the rows of every product: S^T, P^T, dP^T, dS^T are
    # (BLOCK_N keys) x (BLOCK_M queries); only dQ_i = (dS^T)^T K_j needs a transpose.
    tl.static_assert(BLOCK_N % BLOCK_M == 0)      # the causal start below lands on a query tile
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    Q += b * stride_qb + h * stride_qh
    K += b * stride_kb + h * stride_kh
    V += b * stride_vb + h * stride_vh
    DO += b * stride_ob + h * stride_oh
    DK += b * stride_ob + h * stride_oh
    DV += b * stride_ob + h * stride_oh
    DQ += b * stride_ob + h * stride_oh
    LSE += bh * N
    DELTA += bh * N
    start_n = tl.program_id(0) * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + cols[:, None] * stride_kn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
    v = tl.load(V + cols[:, None] * stride_vn + offs_d[None, :], mask=cols[:, None] < N, other=0.0)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    start = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(start, N, BLOCK_M):
        rows = start_m + tl.arange(0, BLOCK_M)
        qT = tl.load(Q + rows[None, :] * stride_qm + offs_d[:, None], mask=rows[None, :] < N, other=0.0)
        doT = tl.load(DO + rows[None, :] * stride_om + offs_d[:, None], mask=rows[None, :] < N, other=0.0)
        lse = tl.load(LSE + rows, mask=rows < N, other=0.0)
        delta = tl.load(DELTA + rows, mask=rows < N, other=0.0)
        sT = _scores(k, qT, qk_scale, PAPER)
        valid = (rows[None, :] < N) & (cols[:, None] < N)
        if CAUSAL:
            valid = valid & (rows[None, :] >= cols[:, None])
        sT = tl.where(valid, sT, float("-inf"))
        pT = tl.exp(sT - lse[None, :]) if PAPER else tl.math.exp2(sT - lse[None, :])
        dv += tl.dot(pT.to(k.dtype), tl.trans(doT))
        dpT = tl.dot(v, doT)
        dsT = (pT * (dpT - delta[None, :])).to(k.dtype)
        dk += tl.dot(dsT, tl.trans(qT))
        if ONE_PASS:
            tl.atomic_add(DQ + rows[:, None] * stride_om + offs_d[None, :], tl.dot(tl.trans(dsT), k),
                          mask=rows[:, None] < N, sem="relaxed")
    out = cols[:, None] * stride_om + offs_d[None, :]
    tl.store(DK + out, (dk * sm_scale).to(DK.dtype.element_ty), mask=cols[:, None] < N)
    tl.store(DV + out, dv.to(DV.dtype.element_ty), mask=cols[:, None] < N)


# (label, kernel: "shipped" or "key-major", head_dim, BLOCK_M queries, BLOCK_N keys, warps, stages, one pass)
VARIANTS = [
    ("two-pass dK/dV (BWD_TUNING)", "shipped", 64, 64, 64, 4, 3, False),
    ("one-pass (ONE_PASS_TUNING)", "shipped", 64, 64, 64, 4, 3, True),
    ("one-pass", "shipped", 64, 64, 64, 4, 2, True),
    ("two-pass dK/dV", "key-major", 64, 64, 64, 4, 3, False),
    ("one-pass", "key-major", 64, 64, 64, 4, 3, True),
    ("one-pass", "key-major", 64, 64, 128, 8, 3, True),
    ("one-pass", "key-major", 64, 32, 128, 8, 3, True),
    ("one-pass", "key-major", 64, 32, 64, 4, 3, True),
    ("two-pass dK/dV (BWD_TUNING)", "shipped", 128, 64, 64, 4, 2, False),
    ("one-pass (ONE_PASS_TUNING)", "shipped", 128, 64, 64, 4, 1, True),
    ("one-pass", "shipped", 128, 64, 64, 4, 2, True),
    ("one-pass", "shipped", 128, 64, 64, 8, 1, True),
    ("two-pass dK/dV", "key-major", 128, 64, 64, 4, 2, False),
    ("one-pass", "key-major", 128, 64, 64, 4, 2, True),
    ("one-pass", "key-major", 128, 64, 64, 8, 2, True),
    ("one-pass", "key-major", 128, 64, 128, 8, 2, True),
    ("one-pass", "key-major", 128, 32, 128, 8, 2, True),
    ("one-pass", "key-major", 128, 32, 64, 4, 2, True),
]
COLUMNS = ("HGMMA", "HMMA", "FADD", "FMUL", "MUFU.EX2", "F2F/F2FP", "BAR.SYNC", "WARPGROUP", "STS/LDS",
           "RED/ATOM", "STL/LDL")


def launch(kind, D, block_m, block_n, warps, stages, one_pass):
    """The dK/dV launch the host makes at the benchmark's seq-4096 shape, with this row's settings."""
    q = torch.empty(sass.BATCH, sass.CHANNELS // D, sass.SEQ, D, dtype=torch.bfloat16)
    lse = torch.empty(q.shape[:3])
    _, (kernel, args, meta), _ = sass.record(lambda: kernels._flash_bwd(q, q, q, q, q, lse, True, "fa2", False,
                                                                        not one_pass))
    if kind == "key-major":
        kernel = _bwd_dkdv_keymajor_kernel
    return kernel, args, dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)


def time_variants(seqs=(4096, 16384)):
    """Median ms of each variant's backward kernels on the GPU at the benchmark's shapes (16k tokens x 2048
    channels): the two-pass rows with the dQ kernel, the one-pass rows with zeroing the fp32 dQ buffer and
    its cast; delta's kernel, the same for all, left out."""
    from triton.testing import do_bench
    print("| variant | form | d | queries x keys | warps | stages | " + " | ".join(f"seq {n} ms" for n in seqs)
          + " |\n|" + "---|" * (6 + len(seqs)))
    for label, kind, D, block_m, block_n, warps, stages, one_pass in VARIANTS:
        cells = [label, kind, D, f"{block_m} x {block_n}", warps, stages]
        for N in seqs:
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v, do = (torch.randn(16384 // N, 2048 // D, N, D, device="cuda", dtype=torch.bfloat16,
                                       generator=g) for _ in range(4))
            o, lse, _ = kernels._flash_fwd(q, k, v, True, False, "O", "fa2", 0, 0, False)
            delta, (kernel, args, meta), last = sass.record(
                lambda: kernels._flash_bwd(do, q, k, v, o, lse, True, "fa2", False, not one_pass))
            grid = lambda block: (triton.cdiv(N, block), q.shape[0] * q.shape[1])  # noqa: E731
            delta[0][grid(delta[2]["BLOCK_M"])](*delta[1], **delta[2])             # delta, for real values
            if kind == "key-major":
                kernel = _bwd_dkdv_keymajor_kernel
            meta = dict(meta, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
            dq_sum = args[8]                                    # the one-pass's fp32 buffer (unused otherwise)

            def run():
                if one_pass:
                    dq_sum.zero_()
                kernel[grid(block_n)](*args, **meta)
                last[0][grid(last[2]["BLOCK_M"])](*last[1], **last[2])     # the dQ kernel, or dQ's cast
            cells.append(f"{do_bench(run, return_mode='median'):.3f}")
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def main():
    if "--time" in sys.argv[1:]:
        return time_variants()
    head = ["variant", "form", "d", "queries x keys", "warps", "stages", "regs", "STL+LDL / stack", "smem KiB",
            "CTAs/SM", "loop", "loop warp-instr. per 64x64 pair", *COLUMNS]
    print(f"triton {triton.__version__}, sm_90; batch {sass.BATCH}, {sass.CHANNELS} channels, seq {sass.SEQ}, "
          "causal, fa2. Loop columns: SASS instructions in one iteration of the loop over the query tiles, per "
          "thread.\n")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for label, kind, D, block_m, block_n, warps, stages, one_pass in VARIANTS:
        m = sass.measure(sass.compile_launch(*launch(kind, D, block_m, block_n, warps, stages, one_pass)))
        per_pair = m["loop"] * warps * 64 * 64 / (block_m * block_n)
        cells = [label, kind, D, f"{block_m} x {block_n}", warps, stages, m["regs"], m["spills"], f"{m['smem_kib']:g}",
                 m["ctas"], m["loop"], f"{per_pair:.0f}", *(m["counts"][c] for c in COLUMNS)]
        print("| " + " | ".join(map(str, cells)) + " |", flush=True)


if __name__ == "__main__":
    main()
