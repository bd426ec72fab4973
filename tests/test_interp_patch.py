"""The interpreter patch must be active; without it every bf16 kernel test below would prove nothing."""
import os

import pytest
import triton

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter patch is only used without a GPU", allow_module_level=True)

from nanolp import interp_patch  # noqa: E402


def test_patch_takes_effect():
    interp_patch.self_test()  # also run by conftest.py; here it shows up as a named test


def test_self_test_fails_without_patch():
    """The self-test must be able to fail: with the stock interpreter restored it has to raise."""
    B, R = interp_patch._Builder, interp_patch._Reduce
    patched = {name: getattr(B if hasattr(B, name) else R, name) for name in interp_patch._orig}
    try:
        for name, fn in interp_patch._orig.items():
            setattr(B if name not in ("sum", "min_max") else R, name, fn)
        with pytest.raises(AssertionError):
            interp_patch.self_test()
    finally:
        for name, fn in patched.items():
            setattr(B if name not in ("sum", "min_max") else R, name, fn)
    interp_patch.self_test()


def test_version_is_pinned():
    assert triton.__version__.startswith(interp_patch.CHECKED_VERSIONS)
