"""Compile every kernel specialization the host code launches, for an H100/H200 (sm_90), with Triton's real
compiler (to PTX and a cubin through the ptxas bundled with Triton), on a machine without a GPU.

    python -m tests.compile_sm90        # without TRITON_INTERPRET; ~1 minute; tests/test_kernels.py runs it

The CPU interpreter the other tests use accepts code the compiler rejects (a loop-carried value changing dtype,
a block shape the layouts cannot take) and runs no constexpr branch it is not given, so without this a kernel
change would meet the compiler only on the next GPU run. The host functions (_flash_fwd, _flash_bwd) run on
CPU tensors with the GPU's tuning, the launches are recorded instead of run, and each distinct one is compiled:
at head_dim 64 the forward in every combination of causal, fix, precision and amplifier (causal only with an
amplifier) and the backward in both precisions with delta from O and from P; at every head_dim the plain forward
and backward, the backward at a short and a long (pipelined) sequence. Compilation only: the numbers are the GPU
tests' job.
"""
import itertools
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "run without TRITON_INTERPRET: it compiles kernels"
import kernels  # noqa: E402  (after the check: TRITON_INTERPRET is read at import)

TARGET = GPUTarget("cuda", 90, 32)
KERNELS = ("_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel", "_bwd_dq_kernel")
POINTEE = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32"}


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
        forward = [(True, False, "fa2", 0, "p")]
        if D == 64:  # every constexpr combination: the amplifiers with causal masking only
            amplifiers = ((0, "p"), (3, "p"), (2, "vo"))
            forward = [(causal, fix, precision, bits, amplify) for causal, fix, precision, (bits, amplify)
                       in itertools.product((True, False), (False, True), ("fa2", "paper"), amplifiers)
                       if causal or not bits]
        for causal, fix, precision, bits, amplify in forward:
            kernels._flash_fwd(q, k, v, causal, fix, precision, 2.0, kernels.TIE_TOL, False, False, bits, amplify, "off")
        backward = [(N, "fa2", False) for N in (kernels.SHORT_SEQ, kernels.SHORT_SEQ + 1)]  # unpipelined, pipelined
        if D == 64:
            backward += [(kernels.SHORT_SEQ, precision, from_p)
                         for precision, from_p in itertools.product(("fa2", "paper"), (False, True))]
        for N, precision, from_p in backward:
            q = k = v = o = torch.zeros(1, 2, N, D, dtype=torch.bfloat16)
            kernels._flash_bwd(o, q, k, v, o, torch.zeros(1, 2, N), True, precision, from_p)
    return launches


def signature(kernel, args, meta):
    """Triton's signature of one launch (a type per argument, "constexpr" for the meta-parameters), the
    constexprs' values, and the compile options."""
    options = {key: meta[key] for key in ("num_warps", "num_stages") if key in meta}
    constexprs = {key: value for key, value in meta.items() if key not in options}
    types = {}
    for name, arg in zip(kernel.arg_names, args):
        if isinstance(arg, torch.Tensor):
            types[name] = POINTEE[arg.dtype]
        else:
            types[name] = "fp32" if isinstance(arg, float) else "i32" if abs(arg) < 2 ** 31 else "i64"
    types.update(dict.fromkeys(constexprs, "constexpr"))
    return types, constexprs, options


def main():
    compiled = set()
    for kernel, args, meta in record_launches():
        types, constexprs, options = signature(kernel, args, meta)
        key = (kernel.fn.__name__, *(tuple(sorted(d.items())) for d in (types, constexprs, options)))
        if key in compiled:
            continue
        positions = {(kernel.arg_names.index(name),): value for name, value in constexprs.items()}
        try:
            triton.compile(ASTSource(kernel, types, positions), target=TARGET, options=options)
        except Exception as error:
            sys.exit(f"{kernel.fn.__name__} {constexprs} {options}: does not compile for sm_90:\n{error}")
        compiled.add(key)
    print(f"{len(compiled)} kernel specializations compile for sm_90 (triton {triton.__version__})")


if __name__ == "__main__":
    main()
