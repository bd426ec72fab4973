"""Test setup. Without a GPU, kernels run on the CPU through Triton's interpreter, patched to be faithful
for bf16 (nanolp/interp_patch.py). With a GPU the same tests run on the compiled kernels.

TRITON_INTERPRET must be set before any module that defines a @triton.jit kernel is imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    from nanolp import interp_patch

    interp_patch.apply()
    interp_patch.self_test()
