"""Compile every kernel specialization the host code launches, for an H100/H200 (sm_90), with Triton's real
compiler (to PTX and a cubin through the ptxas bundled with Triton), on a machine without a GPU.

    python -m nanolp.compile_sm90       # without TRITON_INTERPRET; ~1 minute; tests/test_kernels.py runs it

The CPU interpreter the tests use accepts code the compiler rejects (a loop-carried value changing dtype,
a block shape the layouts cannot take) and runs no constexpr branch it is not given, so without this a kernel
change would meet the compiler only on the next GPU run. The custom ops (kernels.flash_fwd_op, flash_bwd_op) run on
CPU tensors with the GPU's tuning, the launches are recorded instead of run, and each distinct one is compiled
as the GPU's JIT specializes it (specialize): the code that runs, not a generic version with scalar loads and
other pipelining. At head_dim 64 the forward in every combination of causal, the paper's shift, precision and
amplifier (causal only with an amplifier), both forms of the exponent (kernels._exp2), with and without the fp32
O kept beside O (KEEP_O32; causal only), and the backward in both precisions with delta from O and from P and
both exponents; at every head_dim the plain forward, fix "on"'s forward (KEEP_O32) and the plain backward, the
backward at a short and a long (pipelined) sequence. Each must compile to the exponent it says, which the
interpreter would never show: a kernel that computes "fa2"'s exponent as one fused multiply-add
(FMA) has fma.rn in its PTX, and no other kernel has any (kernels.UNFUSED: the compiler contracts nothing itself).
The experiments' one-pass backward: experiments/sass.py and backward_variants.py compile it.
Compilation only: the numbers are the GPU tests' job.
"""
import itertools
import os
import re
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET: it compiles kernels"
import kernels  # noqa: E402  (after the check: TRITON_INTERPRET is read at import)

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
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


def record_launches():
    launches = []
    for name in KERNELS:
        setattr(kernels, name, Recorder(getattr(kernels, name), launches))
    for D in (16, 32, 64, 128):
        q = k = v = torch.zeros(1, 2, kernels.SHORT_SEQ, D, dtype=torch.bfloat16)
        # the plain forward and fix "on"'s (the fp32 O kept beside O: KEEP_O32)
        forward = [(True, "off", "fa2", (0, 0), True, "o"), (True, "on", "fa2", (0, 0), True, "fp32-o")]
        if D == 64:  # every constexpr combination: the amplifiers (P_BITS, O_BITS) with causal masking only,
            amplifiers = ((0, 0), (3, 0), (0, 2))   # the unfused exponent without them ("autocast" has its own),
            combinations = itertools.product((True, False), ("off", "paper"), ("fa2", "autocast"), amplifiers,
                                             (True, False), ("o", "fp32-o"))   # the fp32 O kept (causal only)
            forward = [(causal, fix, precision, bits, fma, delta)
                       for causal, fix, precision, bits, fma, delta in combinations
                       if (causal or (bits == (0, 0) and delta == "o"))
                       and (fma or (precision == "fa2" and bits == (0, 0)))]
        for causal, fix, precision, (p_bits, o_bits), fma, delta in forward:
            kernels.flash_fwd_op(q, k, v, causal, fix, delta, precision, p_bits, o_bits, False, fma)
        # unpipelined, pipelined
        backward = [(N, "fa2", False, True) for N in (kernels.SHORT_SEQ, kernels.SHORT_SEQ + 1)]
        if D == 64:
            backward += [(kernels.SHORT_SEQ, precision, from_p, fma) for precision, from_p, fma in itertools.product(
                ("fa2", "autocast"), (False, True), (True, False)) if fma or precision == "fa2"]
        for N, precision, from_p, fma in backward:
            q = k = v = o = torch.zeros(1, 2, N, D, dtype=torch.bfloat16)
            kernels.flash_bwd_op(o, q, k, v, o, torch.zeros(1, 2, N), True, precision, from_p, fma)
    return launches


def specialize(kernel, args, meta):
    """The source and compile options the GPU's JIT makes of one launch, by the JIT's own steps (JITFunction.run,
    _do_compile): 16-byte aligned pointers and integers divisible by 16 get tt.divisibility, integers equal to 1
    become constants. CPU tensors from torch's allocator are as aligned as CUDA ones."""
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = kernel._pack_args(BACKEND, meta, bound, specialization, options)
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


def main():
    compiled = set()
    for kernel, args, meta in record_launches():
        source, options = specialize(kernel, args, meta)
        key = (source.hash(), str(sorted(options.items())))
        if key in compiled:
            continue
        try:
            ptx = triton.compile(source, target=TARGET, options=options).asm["ptx"]
        except Exception as error:
            sys.exit(f"{kernel.fn.__name__} {source.constants} {meta}: does not compile for sm_90:\n{error}")
        fused = len(re.findall(r"\bfma\.rn\.f(?:32|64)\b", ptx))   # (ptxas fuses nothing either: the same option)
        if bool(fused) != says_fma(kernel, meta):
            sys.exit(f"{kernel.fn.__name__} {source.constants} {meta}: {fused} fused multiply-adds in its PTX, where its "
                     f"exponent is {'one' if says_fma(kernel, meta) else 'none'} (kernels._exp2, kernels.UNFUSED)")
        compiled.add(key)
    print(f"{len(compiled)} kernel specializations compile for sm_90 (triton {triton.__version__})")


if __name__ == "__main__":
    main()
