"""Compile every launch of kernels_gluon.py's forward for an H100/H200 (sm_90) with Triton's real compiler, on a
machine without a GPU (Gluon has no CPU interpreter), and check what nanolp/compile_sm90.py checks of kernels.py:
it compiles; no spills; registers within the budget of one CTA of 8 warps per SM; the only contracted fma in the
PTX is the exponent's (one fma.rn per score: kernels._exp2).

    python -m experiments.compile_gluon_sm90 [--sass DIR]    # without TRITON_INTERPRET; DIR: each cubin's SASS

The launches: each variant at head_dim 64 and 128, causal and not, fix "off", "on" (the fp32 O kept) and "paper"
(the shift), at a sequence length that is not a multiple of the tiles (masked last tiles).
"""
import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.experimental.gluon._runtime import GluonASTSource

from nanolp.compile_sm90 import TARGET, Recorder, specialize  # first: it asserts no TRITON_INTERPRET
from experiments import kernels_gluon  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
MAX_REGS = 255                 # the most ptxas gives a thread; more spills (checked as spills below)
SEQ = 1000                     # not a multiple of the tiles: every variant's masked tiles compile too


def launches(variants=None):
    """(variant, head_dim, causal, fix, kernel, args, meta) of each launch the host code makes."""
    out = []
    for variant, D, causal, fix in itertools.product(variants or kernels_gluon.VARIANTS, (64, 128), (True, False),
                                                     ("off", "on", "paper")):
        name = f"_fwd_{variant}"
        recorded, kernel = [], getattr(kernels_gluon, name)
        setattr(kernels_gluon, name, Recorder(kernel, recorded))
        try:
            q = torch.zeros(4, 2048 // D, SEQ, D, dtype=torch.bfloat16)
            kernels_gluon.check(q, q, q, causal, fix, variant)
            kernels_gluon.launch(q, q, q, causal, fix, variant)
        finally:
            setattr(kernels_gluon, name, kernel)
        out += [(variant, D, causal, fix, *launch) for launch in recorded]
    return out


def compile_launch(kernel, args, meta):
    source, options = specialize(kernel, args, meta)
    source = GluonASTSource(source.fn, source.signature, source.constants, source.attrs)
    return triton.compile(source, target=TARGET, options=options)


def resources(cubin, tmp):
    """(registers, spill bytes (local memory stores + loads), SASS text) read from a cubin with Triton's tools."""
    path = Path(tmp) / "k.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([BIN / "cuobjdump", "-sass", path], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    local = len(re.findall(r"\b(?:STL|LDL)\b", sass))
    return regs, stack, local, sass


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", choices=list(kernels_gluon.VARIANTS))
    p.add_argument("--sass", metavar="DIR", help="write each launch's SASS here")
    args = p.parse_args(argv)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant, D, causal, fix, kernel, largs, meta in launches(args.variants):
            label = f"{variant} d{D} causal={causal} fix={fix}"
            try:
                compiled = compile_launch(kernel, largs, meta)
            except Exception as error:
                while error.__cause__ is not None or error.__context__ is not None:   # the compiler's own
                    error = error.__cause__ or error.__context__
                failed.append(label)
                print(f"{label}: does not compile for sm_90: {error!r}"[:400])
                continue
            regs, stack, local, sass = resources(compiled.asm["cubin"], tmp)
            fused = len(re.findall(r"\bfma\.rn\.f(?:32|64)\b", compiled.asm["ptx"]))
            exps = len(re.findall(r"\bex2\.approx", compiled.asm["ptx"]))
            problems = [f"{local} local loads/stores, stack {stack} B (spills)"] if local or stack else []
            if regs > MAX_REGS:
                problems.append(f"{regs} registers")
            # one fma per score: a thread's share of a 64 x 64 tile (a warpgroup's rows) in each of the two loops
            # (masked and not; "overlap": the first tile and the loop), in each copy of that code
            # ("ws", "overlap": one per consumer warpgroup); no other fma
            want = 2 * 64 * kernels_gluon.BLOCK_N.value // 128 * (2 if variant in ("ws", "overlap") else 1)
            if fused != want:
                problems.append(f"{fused} fma.rn where the exponent has {want}")
            smem = compiled.metadata.shared
            print(f"{label}: {regs} registers, {stack} B stack, {local} STL/LDL, {smem // 1024} KiB shared, "
                  f"{fused} fma.rn and {exps} ex2 in the PTX, {compiled.metadata.num_warps} warps"
                  + (f"; PROBLEM: {'; '.join(problems)}" if problems else ""))
            if problems:
                failed.append(label)
            if args.sass:
                os.makedirs(args.sass, exist_ok=True)
                name = f"{variant}_d{D}_{'causal' if causal else 'full'}_fix-{fix}.sass"
                Path(args.sass, name).write_text(sass)
    print(f"triton {triton.__version__}: {'all compile' if not failed else f'{len(failed)} failed'}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
