"""Compile every kernel specialization the host code launches, for an H100/H200 (sm_90) or another GPU a learner may
have, with Triton's real compiler (to PTX and a cubin through the ptxas bundled with Triton), on a machine without a
GPU, and check that each launch fits that GPU's shared memory.

    python -m nanolp.compile_sm90               # without TRITON_INTERPRET; ~1 minute; tests/test_kernels.py runs it
    python -m nanolp.compile_sm90 --arch 86     # for an RTX 3090 or A10 (SHARED_LIMIT: 80, 86, 89, 90)

The CPU interpreter the tests use accepts code the compiler rejects (a loop-carried value changing dtype,
a block shape the layouts cannot take) and runs no constexpr branch it is not given, so without this a kernel
change would meet the compiler only on the next GPU run. The custom ops (kernels.flash_fwd_op, flash_bwd_op) run on
CPU tensors with the GPU's tuning, the launches are recorded instead of run, and each distinct one is compiled
as the GPU's JIT specializes it (specialize): the code that runs, not a generic version with scalar loads and
other pipelining. At head_dim 64 the forward in every combination of causal, the paper's shift, precision and
amplifier (causal only with an amplifier), both forms of the exponent (kernels._exp2), with and without the fp32
O kept beside O (KEEP_O32; causal only), and the backward in both precisions with delta from O and from P and
both exponents; at every head_dim the plain forward, fix "on"'s forward (KEEP_O32) and the plain backward with
delta from O and from fix "on"'s fp32 O, the backward at a short and a long (pipelined) sequence (--tunings: only
these). Each must compile to the exponent it says, which the interpreter would never show: a kernel that computes
"fa2"'s exponent as one fused multiply-add (FMA) has fma.rn in its PTX, and no other kernel has any
(kernels.UNFUSED: the compiler contracts nothing itself).
Each must also fit: the tuning (kernels.FWD_TUNING, BWD_TUNING) was chosen on sm_90, and a launch whose shared
memory (its tiles times its pipeline's stages, as Triton lays them out for that architecture) passes what one
block may have there fails on that GPU with Triton's OutOfResources. Registers cannot fail a launch (the PTX
requires the block's threads, .reqntid, so ptxas keeps within the register file and spills the rest to local
memory): each launch's registers and stack (its spills) are printed, read from the cubin.
The experiments' one-pass backward: experiments/sass.py and backward_variants.py compile it.
Compilation only: the numbers are the GPU tests' job.
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
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):   # (read when kernels is imported, below)
    sys.exit("nanolp.compile_sm90: run it without TRITON_INTERPRET (unset it): it compiles the kernels, the "
             "interpreter runs them")
import kernels  # noqa: E402  (after the check: TRITON_INTERPRET is read at import)

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
# The most shared memory one block may opt in to, per compute capability (the CUDA C++ Programming Guide's technical
# specifications: 163 KB on an A100, 99 KB on an RTX 3090/A10 and an RTX 4090/L4/L40, 227 KB on an H100/H200): the
# device's MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, which Triton's launcher compares a kernel's shared memory against
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
KERNELS = ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
# specialize() runs the JIT's own binder and _pack_args (triton/runtime/jit.py), internals that take and return
# the same in triton 3.6, 3.8 and 3.9; another version may have changed them
if not (3, 6) <= tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 10):
    raise RuntimeError(f"triton {triton.__version__}: specialize() follows the JIT's internals of triton 3.6 to 3.9; "
                       "check create_function_from_signature and JITFunction._pack_args in this version")


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **meta)` records the launch instead of running it."""

    def __init__(self, kernel, launches):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **meta: self.launches.append((self.kernel, args, meta))


def record_launches(every_combination=True):
    """(kernel, args, meta) of each launch; every_combination False: only the launches of each head_dim's tuning,
    not head_dim 64's other constexprs, which change no launch's shared memory (each took its tuning's plain
    launch's, compiled for every architecture in SHARED_LIMIT with triton 3.6 and 3.9)."""
    launches = []
    for name in KERNELS:
        setattr(kernels, name, Recorder(getattr(kernels, name), launches))
    for D in (16, 32, 64, 128):
        q = k = v = torch.zeros(1, 2, kernels.SHORT_SEQ, D, dtype=torch.bfloat16)
        # the plain forward and fix "on"'s (the fp32 O kept beside O: KEEP_O32)
        forward = [(True, "off", "fa2", (0, 0), True, "o"), (True, "on", "fa2", (0, 0), True, "fp32-o")]
        # every constexpr combination: the amplifiers (P_BITS, O_BITS) with causal masking only,
        if D == 64 and every_combination:
            amplifiers = ((0, 0), (3, 0), (0, 2))   # the unfused exponent without them ("autocast" has its own),
            combinations = itertools.product((True, False), ("off", "paper"), ("fa2", "autocast"), amplifiers,
                                             (True, False), ("o", "fp32-o"))   # the fp32 O kept (causal only)
            forward = [(causal, fix, precision, bits, fma, delta)
                       for causal, fix, precision, bits, fma, delta in combinations
                       if (causal or (bits == (0, 0) and delta == "o"))
                       and (fma or (precision == "fa2" and bits == (0, 0)))]
        for causal, fix, precision, (p_bits, o_bits), fma, delta in forward:
            kernels.flash_fwd_op(q, k, v, causal, fix, delta, precision, p_bits, o_bits, False, fma)
        # unpipelined, pipelined; delta from O and from fix "on"'s fp32 O (another O pointer for the delta kernel)
        backward = [(N, "fa2", False, True, o_dtype) for N in (kernels.SHORT_SEQ, kernels.SHORT_SEQ + 1)
                    for o_dtype in (torch.bfloat16, torch.float32)]
        if D == 64 and every_combination:
            backward += [(kernels.SHORT_SEQ, precision, from_p, fma, torch.bfloat16) for precision, from_p, fma
                         in itertools.product(("fa2", "autocast"), (False, True), (True, False))
                         if fma or precision == "fa2"]
        for N, precision, from_p, fma, o_dtype in backward:
            q = k = v = do = torch.zeros(1, 2, N, D, dtype=torch.bfloat16)
            kernels.flash_bwd_op(do, q, k, v, do.to(o_dtype), torch.zeros(1, 2, N), True, precision, from_p, fma)
    return launches


def specialize(kernel, args, meta, backend=BACKEND):
    """The source and compile options the GPU's JIT makes of one launch, by the JIT's own steps (JITFunction.run,
    _do_compile): 16-byte aligned pointers and integers divisible by 16 get tt.divisibility, integers equal to 1
    become constants. CPU tensors from torch's allocator are as aligned as CUDA ones. backend: the target's
    (make_backend), whose options the JIT would take on that GPU."""
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(backend, meta, bound, specialization, options)
    unaligned = [name for i, (name, arg) in enumerate(zip(kernel.arg_names, args))
                 if isinstance(arg, torch.Tensor) and ["tt.divisibility", 16] not in attrs.get((i,), [])]
    if unaligned:  # the JIT gives every aligned pointer the attribute: without it this compiles other code
        raise RuntimeError(f"{kernel.fn.__name__}: no tt.divisibility on the pointers {unaligned}: the JIT's "
                           f"specialization did not apply (attributes {attrs})")
    return ASTSource(kernel, signature, constexprs, attrs), options.__dict__


EXPONENT_KERNELS = ("_fwd_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")   # the kernels that call kernels._exp2


def says_fma(kernel, meta):
    """Whether the launch computes "fa2"'s exponent as a fused multiply-add (one fma.rn per score in its PTX)."""
    return kernel.fn.__name__ in EXPONENT_KERNELS and bool(meta.get("FMA")) and not meta.get("AUTOCAST")


def registers_and_stack(cubin, tmp):
    """Registers per thread and stack bytes per thread (what ptxas spilled) of a cubin, read by the cuobjdump
    bundled with Triton: the driver reports them (n_regs, n_spills) only when it loads the kernel on a GPU."""
    path = Path(tmp) / "kernel.cubin"
    path.write_bytes(cubin)
    usage = subprocess.run([BIN / "cuobjdump", "-res-usage", path], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1))


def label(kernel, args, meta, source):
    """The launch in one line: its kernel, sequence length, meta-parameters and the pointers that are not bf16."""
    constants = [f"{name}={value}" for name, value in meta.items() if name not in kernels.UNFUSED]
    pointers = [f"{name}:{kind[1:]}" for name, kind in source.signature.items() if kind[0] == "*" and kind != "*bf16"]
    return " ".join([kernel.fn.__name__, f"N={args[kernel.arg_names.index('N')]}", *constants, *pointers])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, choices=sorted(SHARED_LIMIT), default=90,
                        help="compute capability times 10 (default 90: the H100/H200 the tuning was chosen on)")
    parser.add_argument("--tunings", action="store_true",
                        help="only each head_dim's tuning, not head_dim 64's other constexprs (record_launches)")
    options = parser.parse_args(argv)
    arch, limit = options.arch, SHARED_LIMIT[options.arch]
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    kernels.capability = lambda device: divmod(arch, 10)   # the host code's choices for that GPU (SMALL_SHARED)
    compiled, too_big = set(), []
    with tempfile.TemporaryDirectory() as tmp:
        for kernel, args, meta in record_launches(not options.tunings):
            source, compile_options = specialize(kernel, args, meta, backend)
            key = (source.hash(), str(sorted(compile_options.items())))
            if key in compiled:
                continue
            name = label(kernel, args, meta, source)
            try:
                binary = triton.compile(source, target=target, options=compile_options)
            except Exception as error:
                sys.exit(f"{name}: does not compile for sm_{arch}:\n{error}")
            # (ptxas fuses nothing either: the same option)
            fused = len(re.findall(r"\bfma\.rn\.f(?:32|64)\b", binary.asm["ptx"]))
            if bool(fused) != says_fma(kernel, meta):
                sys.exit(f"{name}: {fused} fused multiply-adds in its PTX, where its exponent is "
                         f"{'one' if says_fma(kernel, meta) else 'none'} (kernels._exp2, kernels.UNFUSED)")
            registers, stack = registers_and_stack(binary.asm["cubin"], tmp)
            shared = binary.metadata.shared
            print(f"{name}: {shared} B shared, {registers} registers, {stack} B stack")
            if shared > limit:
                too_big.append(f"{name}: {shared} B")
            compiled.add(key)
    print(f"{len(compiled)} kernel specializations compile for sm_{arch} (triton {triton.__version__})")
    if too_big:
        sys.exit(f"{len(too_big)} of them need more shared memory than a block may have on sm_{arch} ({limit} B):\n"
                 + "\n".join(too_big))
    print(f"each fits sm_{arch}'s {limit} B of shared memory per block")


if __name__ == "__main__":
    main()
