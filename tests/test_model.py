"""model.py: shapes, tied embeddings, the attention backends against each other and the fp32 reference, the
FLOPs estimate. (nanolp/diagnostics.py on a small model: tests/test_diagnostics.py.)"""
import math

import pytest
import torch

from kernels import Numerics
from model import GPT, GPTConfig, attention, reference_attention
from torch.utils.flop_counter import FlopCounterMode

SMALL = dict(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64)
BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def small_gpt(attn="sdpa"):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL, attn=attn))


def batch(B=4, T=64):
    g = torch.Generator().manual_seed(1)
    return torch.randint(65, (B, T), generator=g), torch.randint(65, (B, T), generator=g)


def test_shapes_and_tied_embeddings():
    model = small_gpt()
    x, y = batch(3, 40)
    logits, loss = model(x, y)
    assert logits.shape == (3, 40, 65)
    assert abs(loss.item() - math.log(65)) < 0.1  # small init: close to a uniform guess
    assert model(x)[1] is None
    assert model.lm_head.weight is model.transformer.wte.weight  # one matrix, counted once by parameters()


def qkv(logit_scale=1.0, B=2, H=2, T=64, D=32):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    return (q * logit_scale).bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("attn, fix", [("sdpa", "off"), ("emulate", "off"), ("emulate", "on"), ("kernel", "on")])
def test_backends_agree_with_fp32_reference(attn, fix):
    """Each backend against plain fp32 softmax attention; "kernel" is whatever computes it on this machine (on a
    CPU the emulation, on a GPU the Triton kernel), so this also checks what attn "kernel" runs here."""
    q, k, v = qkv(logit_scale=3.0)
    config = GPTConfig(**SMALL, attn=attn, fix=fix)
    ref = reference_attention(q, k, v).float()
    out = attention(q, k, v, config).float()
    assert out.shape == ref.shape
    # one bf16 rounding of O (and of P in the flash algorithm) apart: relative 2^-8 per element at most
    assert (out - ref).abs().max() <= 2 * 2**-8 * ref.abs().max()


@pytest.mark.parametrize("attn", ["fp32", "emulate"])
def test_models_train_alike(attn):
    """Same weights, same batch, bf16 autocast: loss and gradients of each backend match SDPA closely."""
    x, y = batch()
    results = {}
    for name in ("sdpa", attn):
        model = small_gpt(name)
        with BF16:
            loss = model(x, y)[1]
        loss.backward()
        results[name] = loss.item(), model.transformer.h[1].attn.c_attn.weight.grad
    (loss_a, grad_a), (loss_b, grad_b) = results.values()
    assert abs(loss_a - loss_b) < 1e-3
    assert (grad_a - grad_b).norm() < 0.02 * grad_a.norm()


def test_flops_per_token_matches_torchs_flop_counter():
    """torch's FlopCounterMode counts the matmuls of one training step (forward and backward) with fp32 attention,
    whose scores and P V are plain matmuls over all T keys, as the estimate assumes. The counter sees matmuls only:
    the estimate's 6N also counts each bias and LayerNorm gain (6 FLOPs a token each, as PaLM counts N)."""
    model = small_gpt("fp32")
    x, y = batch()
    with FlopCounterMode(display=False) as counter:
        model(x, y)[1].backward()
    vectors = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    assert counter.get_total_flops() / x.numel() + 6 * vectors == model.flops_per_token()


def test_delta_options_reach_the_backward_only():
    """delta "fp32-o" and "p" change the gradients the model gets (in their last bits), never the loss."""
    x, y = batch(2)
    results = []
    for numerics in (Numerics(), Numerics(delta="fp32-o"), Numerics(delta="p")):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL, attn="emulate", numerics=numerics))
        with BF16:
            _, loss = model(x, y)
        loss.backward()
        results.append((loss.item(), model.transformer.h[0].attn.c_attn.weight.grad))
    (loss, grad), *others = results
    for other_loss, other_grad in others:
        assert other_loss == loss and not torch.equal(other_grad, grad)
        assert torch.allclose(other_grad, grad, rtol=0.05, atol=1e-4)


def test_kernel_options_need_our_kernel():
    """--fix on with torch's SDPA would silently train without the fix: refuse it, naming the option."""
    for name, option in (("fix", dict(fix="on")), ("fix", dict(fix="paper")),
                         ("delta", dict(numerics=Numerics(delta="fp32-o"))),
                         ("mantissa_bits", dict(numerics=Numerics(mantissa_bits=3)))):
        with pytest.raises(ValueError, match=f"{name}: only our kernel"):
            GPT(GPTConfig(**SMALL, attn="sdpa", **option))
    GPT(GPTConfig(**SMALL, attn="emulate", numerics=Numerics(delta="fp32-o")))   # fine
