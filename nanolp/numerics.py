"""The attention's experiment switches (kernels.flash_attention's numerics=): how the kernel rounds, for
studying the failure, and the host-side roundings only the experiments use. The defaults are plain
FlashAttention-2; training a model needs none of this. kernels.py reads it (its appendix, _round_bits, is the
kernels' side); it imports nothing of this project, so kernels.py stays a leaf above the library."""
from dataclasses import dataclass, field, fields

import torch


def option(help, default, choices=None):
    """A field of Numerics: what it does (also its train.py flag's help), its default, the values it takes."""
    return field(default=default, metadata=dict(help=help, choices=choices))


@dataclass(frozen=True)
class Numerics:
    """How the attention rounds, for studying the failure; the defaults are plain FlashAttention-2. Each field
    is also a train.py flag, a config.json/summary.json key and a runs.csv column (docs/kernel.md)."""
    precision: str = option("fa2: S, m, l and acc in fp32 (production kernels); autocast: the rounding points of "
                            "the paper's PyTorch code under bf16 autocast", "fa2", ("fa2", "autocast"))
    delta: str = option("what the backward's delta reads (fp32-o with fix on): o, the O returned (the paper's "
                        "channel); fp32-o, the forward's fp32 O, before its final cast (the fix's cure without the "
                        "shift); p, rowsum(dP * P) from P recomputed in fp32 (the paper's control); stochastic-o, an "
                        "independent stochastic rounding of the fp32 O", "o", ("o", "fp32-o", "p", "stochastic-o"))
    stochastic_o: str = option("forward: O stochastically rounded in the forward, the O that the next layer reads "
                               "(and delta, with delta o)", "off", ("off", "forward"))
    mantissa_bits: int = option("the amplifier: P (or V and O) rounded to 1-6 mantissa bits (3: FP8); 0: off",
                                0, range(7))
    amplify: str = option("what mantissa_bits rounds: P before P V, or V and O (amplifies the tie bias)",
                          "p", ("p", "vo"))
    exponent: str = option("softmax's exponent S * scale - m: fma, one fused multiply-add (FlashAttention-2 as "
                           "its authors ship it); torch, S * scale rounded first (PyTorch's build of FA2)",
                           "fma", ("fma", "torch"))

    def __post_init__(self):
        for f in fields(self):
            value, choices = getattr(self, f.name), f.metadata["choices"]
            if type(value) is not f.type:
                raise ValueError(f"{f.name} must be a {f.type.__name__}, got {value!r}")
            if choices is not None and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
        if self.amplify != "p" and self.mantissa_bits == 0:
            raise ValueError(f"amplify={self.amplify!r} says what mantissa_bits rounds: "
                             "give mantissa_bits 1-6")
        if self.exponent != "fma" and self.precision == "autocast":
            raise ValueError('exponent="torch" is a form of the "fa2" exponent; precision="autocast" rounds S on its '
                             "own (in natural units): choose one")
        if self.stochastic_o == "forward" and self.delta == "stochastic-o":
            raise ValueError('stochastic_o="forward" and delta="stochastic-o" are different stochastic roundings of '
                             "the O that delta reads: choose one")

    @property
    def fma(self):
        """Whether the exponent is one fused multiply-add (kernels._exp2)."""
        return self.exponent == "fma"

    @property
    def p_bits(self):
        """The amplifier on P: mantissa bits P is rounded to before P V (0: the input dtype's)."""
        return self.mantissa_bits if self.amplify == "p" else 0

    @property
    def o_bits(self):
        """The amplifier on V and O: mantissa bits V is rounded to before attention reads it, and O before its
        final cast (0: none)."""
        return self.mantissa_bits if self.amplify == "vo" else 0


def stochastic_round(x, generator=None):
    """Round fp32 x to bfloat16 stochastically, unbiased (E[result] = x): 16 random bits added below bf16's
    mantissa, then truncated. For the stochastic-rounding experiments only."""
    noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    bits = (x.view(torch.int32) + noise) & -(1 << 16)    # sign-magnitude: |x| rounded up or down, to bf16
    rounded = torch.where(torch.isfinite(x), bits.view(torch.float32), x)
    return torch.empty_like(x, dtype=torch.bfloat16).copy_(rounded)    # in x's layout


def round_mantissa(x, bits):
    """Round values to `bits` explicit mantissa bits (ties to even) on their float32 bit pattern, keeping
    float32's exponent range; returned as float32. bits=7 is bfloat16, 3 the mantissa of FP8 e4m3."""
    assert 0 <= bits <= 23
    drop = 23 - bits
    if drop == 0:
        return x.float()
    b = x.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    half = (1 << (drop - 1)) - 1
    b = (b + half + ((b >> drop) & 1)) >> drop << drop
    out = (b & 0xFFFFFFFF).to(torch.int64)
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isfinite(x), out, x.float())


def amplified_v(v, bits):
    """amplify="vo" (bits: Numerics.o_bits): V rounded to bits before attention sees it, so the forward and
    the backward read the same V; its gradient passes straight through to the unrounded V."""
    if not bits:
        return v
    return round_mantissa(v, bits).to(v.dtype).detach() + (v - v.detach())


def widening(bits):
    """How much wider than bf16's the band of scores whose P rounds to 1.0 is, P at `bits` bits (0: bf16)."""
    return 2.0 ** (7 - bits) if bits else 1.0
