"""What the compiled kernels spend their instructions on: registers, spills, shared memory and the SASS of the
main key loop, per kernel, compiled for the H200 (sm_90) on a machine without a GPU.

    python -m experiments.sass            # from the repository root, without TRITON_INTERPRET; ~30 s

The H200 runs triton 3.6 (results/speed/gpu_tests.txt); the code it compiles differs from later versions' (registers,
so CTAs per SM), so compile with that version: pip install --no-deps --target /tmp/triton36 triton==3.6.0, then
PYTHONPATH=/tmp/triton36 python -m experiments.sass.

Each launch is the one the benchmark makes (python -m experiments.bench: batch 4, 2048 channels, seq 4096, causal,
precision fa2, no amplifier), recorded from the host code and compiled with the argument specialization the
GPU's JIT gives it, both as nanolp/compile_sm90.py does (its specialize: 16-byte aligned pointers, strides divisible
by 16; without that the loads are not vectorized and the pipeliner leaves the K/V loads unpipelined, so the code is
not the one that ran). Prints markdown tables (results/speed/sass.md).
"""
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

from nanolp.compile_sm90 import TARGET, Recorder, specialize  # first: it asserts no TRITON_INTERPRET
import kernels  # after the check: TRITON_INTERPRET is read at import

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
BATCH, CHANNELS, SEQ = 4, 2048, 4096
# H100/H200 per SM: 65536 registers, allocated per warp in units of 256; 228 KiB shared memory, 1 KiB of it
# reserved per resident CTA; at most 64 warps.
SM_REGS, SM_SHARED, CTA_RESERVED, SM_WARPS = 65536, 228 * 1024, 1024, 64
SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
# Columns of the loop table: a name and the opcode prefixes it counts.
CLASSES = {
    "HGMMA": ("HGMMA",), "HMMA": ("HMMA",), "SHFL": ("SHFL",), "FMNMX": ("FMNMX",), "FADD": ("FADD",),
    "FMUL": ("FMUL",),
    "FFMA": ("FFMA",), "MUFU.EX2": ("MUFU.EX2",), "MUFU.RCP": ("MUFU.RCP",), "F2F/F2FP": ("F2F",),
    "FSETP/FSEL": ("FSETP", "FSEL"), "int SEL/LOP3/POPC/IADD": ("SEL", "LOP3", "POPC", "IADD3", "IMAD.IADD"),
    "P2R/R2P": ("P2R", "R2P"), "FCHK/FRND": ("FCHK", "FRND"), "BRA/CALL": ("BRA", "CALL"),
    "BAR.SYNC": ("BAR.SYNC",), "WARPGROUP": ("WARPGROUP",), "LDGSTS": ("LDGSTS",),
    "STS/LDS": ("STS", "LDS"), "RED/ATOM": ("RED.", "REDG", "ATOM"), "STL/LDL": ("STL", "LDL"),
}


def record(run):
    """The launches run() makes, recorded instead of run."""
    launches, saved = [], {name: getattr(kernels, name) for name in
                           ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel",
                            "_bwd_dq_cast_kernel")}
    for name, kernel in saved.items():
        setattr(kernels, name, Recorder(kernel, launches))
    try:
        run()
    finally:
        for name, kernel in saved.items():
            setattr(kernels, name, kernel)
    return launches


def launches():
    """(label, kernel, args, meta) for the forward with the shift off/on and O in bf16/fp32, and the backward."""
    out = []
    for D in (64, 128):
        q = torch.empty(BATCH, CHANNELS // D, SEQ, D, dtype=torch.bfloat16)
        for shift in (False, True):
            for fp32_o in (False, True):
                (launch,) = record(lambda: kernels._flash_fwd(q, q, q, True, shift, "fp32 O" if fp32_o else "O",
                                                              "fa2", 0, 0, False))
                out.append((f"fwd d{D} shift {'on' if shift else 'off'}, O {'fp32' if fp32_o else 'bf16'}", *launch))
        lse = torch.empty(q.shape[:3])
        delta, dkdv, dq = record(lambda: kernels._flash_bwd(q, q, q, q, q, lse, True, "fa2", False))
        # with fix=True delta reads the forward's fp32 O; the other backward kernels never read O
        (delta_fp32, _, _) = record(lambda: kernels._flash_bwd(q, q, q, q, q.float(), lse, True, "fa2", False))
        out += [(f"bwd delta d{D}, O bf16", *delta), (f"bwd delta d{D}, O fp32", *delta_fp32),
                (f"bwd dkdv d{D}", *dkdv), (f"bwd dq d{D}", *dq)]
        # the one-pass backward (deterministic=False): dK/dV with dQ through atomics, then dQ's scale and cast
        (_, one_pass, cast) = record(lambda: kernels._flash_bwd(q, q, q, q, q, lse, True, "fa2", False, False))
        out += [(f"bwd one-pass dkdv+dq d{D}", *one_pass), (f"bwd one-pass dq cast d{D}", *cast)]
    return out


def compile_launch(kernel, args, meta):
    source, options = specialize(kernel, args, meta)
    return triton.compile(source, target=TARGET, options=options)


def main_loop(sass):
    """Opcodes of the first loop (a backward branch's span) that contains an HGMMA: in the forward, the loop over
    the key tiles left of the diagonal, where a program spends almost all its tiles at long sequences."""
    instructions = [(int(address, 16), opcode, operands) for address, opcode, operands in SASS_LINE.findall(sass)]
    for address, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            body = [op for a, op, _ in instructions if int(target.group(1), 16) <= a <= address]
            if any(op.startswith("HGMMA") for op in body):
                return body
    return []


def measure(compiled):
    """Resources and instruction counts of one compiled kernel, read from its cubin with the tools in Triton."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        Path(cubin).write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True, check=True)
        sass = subprocess.run([BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage.stdout)}
    opcodes = [op for _, op, _ in SASS_LINE.findall(sass)]
    warps, dynamic = compiled.metadata.num_warps, compiled.metadata.shared
    warp_regs = -(-res["REG"] * 32 // 256) * 256
    ctas = min(SM_REGS // (warp_regs * warps), SM_SHARED // (dynamic + res["SHARED"] + CTA_RESERVED), SM_WARPS // warps)
    loop = main_loop(sass)
    counts = {name: sum(op.startswith(prefixes) for op in loop) for name, prefixes in CLASSES.items()}
    return dict(regs=res["REG"], spills=f'{sum(op.startswith(("STL", "LDL")) for op in opcodes)} / {res["STACK"]}',
                warps=warps, stages=compiled.metadata.num_stages, smem_kib=(dynamic + res["SHARED"]) / 1024,
                ctas=ctas, total=len(opcodes), loop=len(loop), counts=counts)


def table(rows):
    head = ["kernel", "regs", "STL+LDL / stack bytes", "warps", "stages", "smem KiB", "CTAs/SM", "SASS total", "loop"]
    lines = ["| " + " | ".join(head + list(CLASSES)) + " |", "|" + "---|" * (len(head) + len(CLASSES))]
    for label, m in rows:
        cells = [label, m["regs"], m["spills"], m["warps"], m["stages"], f"{m['smem_kib']:g}", m["ctas"], m["total"],
                 m["loop"], *m["counts"].values()]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def main():
    rows = [(label, measure(compile_launch(kernel, args, meta))) for label, kernel, args, meta in launches()]
    print(f"triton {triton.__version__}, sm_90; batch {BATCH}, {CHANNELS} channels, seq {SEQ}, causal, fa2. "
          "Loop columns: SASS instructions in one iteration of the main key loop, per thread.\n")
    print(table(rows))


if __name__ == "__main__":
    main()
