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

    PYTHONPATH=/tmp/triton36 python -m experiments.sass --fwd 128/8/2/maxnreg=128 64/4/1    # ~7 s a setting

With --fwd, only the forward at one head_dim (--head-dim, 128 by default) with fix "off", "paper" and "on", at
FWD_TUNING's setting and at each one given, in experiments/forward_split.py's form (BLOCK_M/WARPS/STAGES, then
optionally /maxnreg=R and /block_n=N), which times the same settings on a GPU
(results/speed/forward_d128_candidates.md).
"""
import argparse
import os
import re
import subprocess
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
import triton
from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

from nanolp.compile_sm90 import TARGET, Recorder, specialize  # first: it asserts no TRITON_INTERPRET
import kernels  # after the check: TRITON_INTERPRET is read at import
from experiments import launch_variants
from experiments.forward_split import FwdConfig, forward_config

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


# The kernels record() records: kernels.py's and the one-pass backward's
RECORDED = ((kernels, ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")),
            (launch_variants, ("_bwd_dkdv_dq_kernel", "_bwd_dq_cast_kernel")))


def record(run):
    """The launches run() makes, recorded instead of run."""
    launches = []
    saved = [(module, name, getattr(module, name)) for module, names in RECORDED for name in names]
    for module, name, kernel in saved:
        setattr(module, name, Recorder(kernel, launches))
    try:
        run()
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)
    return launches


# The forward's variants: label: (fix, what delta reads). fix="off" is the first, fix="paper" the third, fix="on"
# the second (the fp32 O, no shift: the kernel it launches is fix "off"'s with delta "fp32-o"), fix="paper" with
# delta="fp32-o" the fourth.
FORWARD = {"shift off, O bf16": ("off", "o"), "shift off, O bf16 + fp32": ("off", "fp32-o"),
           "shift on, O bf16": ("paper", "o"), "shift on, O bf16 + fp32": ("paper", "fp32-o")}
FIXES = {'fix="off"': ("off", "o"), 'fix="paper"': ("paper", "o"), 'fix="on"': ("on", "fp32-o")}


def forward_launches(D, variants, config=None):
    """(label, launch) of the forward at head_dim D in each variant, with FWD_TUNING or a FwdConfig."""
    q = torch.empty(BATCH, CHANNELS // D, SEQ, D, dtype=torch.bfloat16)

    def run(fix, delta):
        # the op itself, not kernels.forward, whose device check would refuse CPU tensors (nothing runs here)
        with forward_config(D, config) if config else nullcontext():
            kernels.flash_fwd_op(q, q, q, True, fix, delta, "fa2", 0, 0, False, True)
    return [(label, *record(lambda: run(fix, delta))) for label, (fix, delta) in variants.items()]


def launches():
    """(label, kernel, args, meta) for the forward with the shift off/on and O in bf16/fp32, and the backward."""
    out = []
    for D in (64, 128):
        out += [(f"fwd d{D} {label}", *launch) for label, launch in forward_launches(D, FORWARD)]
        q = torch.empty(BATCH, CHANNELS // D, SEQ, D, dtype=torch.bfloat16)
        lse = torch.empty(q.shape[:3])
        delta, dkdv, dq = record(lambda: kernels.flash_bwd_op(q, q, q, q, q, lse, True, "fa2", False, True))
        # with fix "on" delta reads the forward's fp32 O; the other backward kernels never read O
        (delta_o32, _, _) = record(lambda: kernels.flash_bwd_op(q, q, q, q, q.float(), lse, True, "fa2", False, True))
        out += [(f"bwd delta d{D}, O bf16", *delta), (f"bwd delta d{D}, O fp32", *delta_o32),
                (f"bwd dkdv d{D}", *dkdv), (f"bwd dq d{D}", *dq)]
        # the one-pass backward (experiments/launch_variants.py): dK/dV with dQ through atomics, then dQ's cast
        (_, one_pass, cast) = record(lambda: launch_variants.one_pass_backward(q, q, q, q, q, lse, True, "fa2", False,
                                                                              True, tma=False))
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
        # Whether ptxas serialized the wgmma (each HGMMA then waits for the one before it), and why, is only in
        # its log, which Triton does not keep: ptxas again, with the options Triton 3.6
        # gives it (later versions add others)
        ptx = os.path.join(tmp, "k.ptx")
        Path(ptx).write_text(compiled.asm["ptx"])
        arch = sm_arch_from_capability(TARGET.arch)
        log = subprocess.run([get_ptxas(TARGET.arch).path, "-lineinfo", "-v", f"--gpu-name={arch}", ptx,
                              "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True)
        log = log.stdout + log.stderr
    res = {key: int(value) for key, value in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", usage.stdout)}
    opcodes = [op for _, op, _ in SASS_LINE.findall(sass)]
    warps, dynamic = compiled.metadata.num_warps, compiled.metadata.shared
    warp_regs = -(-res["REG"] * 32 // 256) * 256
    ctas = min(SM_REGS // (warp_regs * warps), SM_SHARED // (dynamic + res["SHARED"] + CTA_RESERVED), SM_WARPS // warps)
    loop = main_loop(sass)
    counts = {name: sum(op.startswith(prefixes) for op in loop) for name, prefixes in CLASSES.items()}
    return dict(regs=res["REG"], spills=f'{sum(op.startswith(("STL", "LDL")) for op in opcodes)} / {res["STACK"]}',
                warps=warps, stages=compiled.metadata.num_stages, smem_kib=(dynamic + res["SHARED"]) / 1024,
                ctas=ctas, total=len(opcodes), loop=len(loop), counts=counts, loop_opcodes=loop,
                # "?" where this ptxas run allocated other registers than Triton's: not the same compile; else
                # the code of ptxas's "wgmma.mma_async instructions are serialized" (C7512: registers; C7514,
                # C7515: other instructions reading or writing a wgmma's accumulator while it runs), or None
                serialized=(next(iter(re.findall(r"\((C75\d\d)\)[^\n]*wgmma[^\n]*serialized", log)), None)
                            if f"Used {res['REG']} registers" in log else "?"))


def table(rows):
    head = ["kernel", "regs", "STL+LDL / stack bytes", "warps", "stages", "smem KiB", "CTAs/SM", "SASS total", "loop"]
    lines = ["| " + " | ".join(head + list(CLASSES)) + " |", "|" + "---|" * (len(head) + len(CLASSES))]
    for label, m in rows:
        cells = [label, m["regs"], m["spills"], m["warps"], m["stages"], f"{m['smem_kib']:g}", m["ctas"], m["total"],
                 m["loop"], *m["counts"].values()]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


def print_candidates(D, configs):
    """The forward at head_dim D in each fix variant, with FWD_TUNING and with each FwdConfig, printed row by row
    as it compiles: table()'s columns, whether ptxas serialized the wgmma, the warps an SM holds (the warp groups
    that can hide each other's softmax behind their MMAs) and the loop's warp-instructions per 64 x 64 (query x
    key) tile, the instruction cost of the same work across tile shapes."""
    head = ["setting", "fix", "regs", "STL+LDL / stack bytes", "wgmma serialized", "warps", "stages", "smem KiB",
            "CTAs/SM", "warps/SM", "SASS total", "loop", "loop warp-instr. per 64x64 tile"]
    print("| " + " | ".join(head + list(CLASSES)) + " |\n|" + "---|" * (len(head) + len(CLASSES)))
    for config in [FwdConfig(*kernels.FWD_TUNING[D])] + configs:
        for label, launch in forward_launches(D, FIXES, config):
            m = measure(compile_launch(*launch))
            per_tile = m["loop"] * m["warps"] * 64 * 64 / (config.block_m * config.block_n)
            serialized = "?" if m["serialized"] == "?" else f"yes ({m['serialized']})" if m["serialized"] else "no"
            cells = [config, label, m["regs"], m["spills"], serialized, m["warps"], m["stages"], f"{m['smem_kib']:g}",
                     m["ctas"], m["ctas"] * m["warps"], m["total"], m["loop"], f"{per_tile:.0f}", *m["counts"].values()]
            print("| " + " | ".join(map(str, cells)) + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fwd", type=FwdConfig.parse, nargs="+", metavar="CONFIG",
                   help="only the forward, with FWD_TUNING and these settings: BLOCK_M/WARPS/STAGES[/maxnreg=R]"
                        "[/block_n=N] (experiments/forward_split.py)")
    p.add_argument("--head-dim", type=int, default=128, choices=sorted(kernels.FWD_TUNING),
                   help="the forward's head_dim with --fwd")
    options = p.parse_args()
    print(f"triton {triton.__version__}, sm_90; batch {BATCH}, {CHANNELS} channels, seq {SEQ}, causal, fa2. "
          "Loop columns: SASS instructions in one iteration of the main key loop, per thread.\n")
    if options.fwd:
        return print_candidates(options.head_dim, options.fwd)
    rows = [(label, measure(compile_launch(kernel, args, meta))) for label, kernel, args, meta in launches()]
    print(table(rows))


if __name__ == "__main__":
    main()
