"""kernels.py's experiments' switches (Numerics) refuse what they do not take, and the host-side roundings round
as they say."""
import re

import pytest
import torch

from kernels import Numerics, round_mantissa, stochastic_round


def test_bad_numerics_refused():
    for precision in ("fp8", "paper"):   # ("paper" is the fix's word: the paper's rounding points are "autocast")
        with pytest.raises(ValueError, match="precision"):
            Numerics(precision=precision)
    with pytest.raises(ValueError, match="mantissa_bits"):
        Numerics(mantissa_bits=7)
    with pytest.raises(ValueError, match="mantissa_bits"):
        Numerics(mantissa_bits=True)
    with pytest.raises(ValueError, match="amplify"):
        Numerics(mantissa_bits=3, amplify="o")
    for delta in ("yes", "O", True):
        with pytest.raises(ValueError, match="delta must be"):
            Numerics(delta=delta)
    with pytest.raises(ValueError, match="choose one"):
        Numerics(stochastic_o="forward", delta="stochastic-o")
    with pytest.raises(ValueError, match="choose one"):
        Numerics(precision="autocast", exponent="torch")
    for stochastic_o in ("up", "delta"):   # ("delta": delta="stochastic-o")
        with pytest.raises(ValueError, match="stochastic_o"):
            Numerics(stochastic_o=stochastic_o)


def test_draws_is_a_stochastic_rounding_of_o():
    """The arms that draw from torch's generator (train.py forks it around its evaluation and diagnostics)."""
    assert not Numerics().draws and not Numerics(delta="fp32-o").draws and not Numerics(mantissa_bits=3).draws
    assert Numerics(stochastic_o="forward").draws and Numerics(delta="stochastic-o").draws


def test_round_mantissa_is_bf16_at_seven_bits():
    """Ties to even on the bit pattern, both signs, every exponent; non-finite values kept: at 7 bits, bfloat16's
    own rounding. At 3 bits each result has at most 3 mantissa bits and is the nearer of its two neighbours."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=g, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    x = torch.cat([x, torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), float("inf"), -float("inf"), 0.0])])
    finite = torch.isfinite(x)
    assert torch.equal(round_mantissa(x, 7)[finite], x[finite].bfloat16().float())
    assert torch.equal(round_mantissa(x, 7)[~finite].view(torch.int32), x[~finite].view(torch.int32))   # bit for bit
    for bits in (-1, 24, 3.0):   # one line, not a shift by a negative count or bits silently wrong
        with pytest.raises(ValueError, match=re.escape(f"an integer 0-23, got {bits!r}")):
            round_mantissa(x, bits)
    y = torch.linspace(1, 2, 1001, dtype=torch.float32)
    r = round_mantissa(y, 3)
    assert torch.equal(r * 8, (r * 8).round())                      # 1 <= y <= 2: a multiple of 1/8
    assert ((r - y).abs() <= 1 / 16).all()


def test_stochastic_round_takes_float32_alone():
    """Its bits are read as int32: a bf16 or fp16 tensor is refused in one line, not a shape error."""
    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(TypeError, match=f"stochastic_round rounds float32 to bfloat16, got {dtype}"):
            stochastic_round(torch.ones(2, 64, dtype=dtype))
