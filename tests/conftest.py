"""Test setup. Without a GPU, kernels run on the CPU through Triton's interpreter, patched to be faithful
for bf16 (tests/interp_patch.py). With a GPU the same tests run on the compiled kernels.

TRITON_INTERPRET must be set before any module that defines a @triton.jit kernel is imported.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests import interp_patch

    interp_patch.apply()
    interp_patch.self_test()
