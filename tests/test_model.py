"""model.py: shapes, tied embeddings, the attention backends against each other and the fp32 reference, the
FLOPs estimate. (nanolp/diagnostics.py on a small model: tests/test_diagnostics.py.)"""
import math

import pytest
import torch

import kernels
from kernels import Numerics
from model import GPT, GPTConfig, attention, reference_attention
from torch.utils.flop_counter import FlopCounterMode

SMALL = dict(vocab_size=65, block_size=64, n_layer=2, n_head=2, n_embd=64)
BF16 = torch.autocast("cpu", dtype=torch.bfloat16)


def small_gpt(attn="sdpa"):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL, attn=attn, fix="off"))


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


@pytest.mark.parametrize("attn, fix", [("sdpa", "off"), ("emulate", "off"), ("emulate", "on"), ("emulate", "paper"),
                                       ("kernel", "on")])
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


def qkv_grads(model):
    """Each layer's gradient of W_Q, W_K and W_V (c_attn's three row blocks): a slice each, so that an error in dQ or
    dK is not lost under dV's larger norm."""
    return [grad for block in model.transformer.h for grad in block.attn.c_attn.weight.grad.chunk(3)]


def relative_errors(grads, reference):
    return [float((g - r).norm() / r.norm()) for g, r in zip(grads, reference, strict=True)]


@pytest.mark.parametrize("attn", ["fp32", "emulate", "kernel"])
def test_models_train_alike(attn):
    """Same weights, same batch, bf16 autocast: loss and each layer's W_Q, W_K and W_V gradients of each backend
    match SDPA's closely (~0.5% apart, the bf16 roundings'; "kernel" is what computes it on this machine)."""
    x, y = batch()
    results = {}
    for name in ("sdpa", attn):
        model = small_gpt(name)
        with BF16:
            loss = model(x, y)[1]
        loss.backward()
        results[name] = loss.item(), qkv_grads(model)
    (loss_a, grads_a), (loss_b, grads_b) = results.values()
    assert abs(loss_a - loss_b) < 1e-3
    assert max(relative_errors(grads_b, grads_a)) < 0.015


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
    """delta "fp32-o" and "p" change the gradients the model gets (by a few tenths of a per cent, bf16's last bits),
    never the loss."""
    x, y = batch(2)
    results = []
    for numerics in (Numerics(), Numerics(delta="fp32-o"), Numerics(delta="p")):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL, attn="emulate", fix="off", numerics=numerics))
        with BF16:
            _, loss = model(x, y)
        loss.backward()
        results.append((loss.item(), qkv_grads(model)))
    (loss, grads), *others = results
    for other_loss, other_grads in others:
        assert other_loss == loss and not torch.equal(torch.cat(other_grads), torch.cat(grads))
        assert max(relative_errors(other_grads, grads)) < 0.01   # (~0.25% apart)


def test_kernel_options_need_our_kernel():
    """--fix on with torch's SDPA would silently train without the fix: refuse it, naming the option."""
    for name, option in (("fix", dict(fix="on")), ("fix", dict(fix="paper")),
                         ("delta", dict(fix="off", numerics=Numerics(delta="fp32-o"))),
                         ("mantissa_bits", dict(fix="off", numerics=Numerics(mantissa_bits=3)))):
        with pytest.raises(ValueError, match=f"{name}: only our kernel"):
            GPT(GPTConfig(**SMALL, attn="sdpa", **option))
    GPT(GPTConfig(**SMALL, attn="emulate", fix="off", numerics=Numerics(delta="fp32-o")))   # fine


def test_rotary_positions_turn_channel_pairs_and_keep_relative_scores():
    """rotate() against rotary positions written with complex numbers in float64 (channel j and j + D/2 as one
    complex number, turned by t * base^(-2j/D)), and the property that makes them positions: a score q_m . k_n
    depends on m and n only through m - n (the same q and k at every position give a Toeplitz score matrix)."""
    from model import ROPE_BASE, rotary_angles, rotate
    T, D = 50, 32
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, T, D, generator=g)
    z = torch.complex(*x.double().chunk(2, dim=-1))
    theta = ROPE_BASE ** -(torch.arange(D // 2, dtype=torch.float64) * 2 / D)
    turned = z * torch.polar(torch.ones(T, D // 2, dtype=torch.float64), torch.arange(T)[:, None] * theta)
    expected = torch.cat((turned.real, turned.imag), dim=-1)
    assert torch.allclose(rotate(x, rotary_angles(T, D)).double(), expected, atol=1e-5)

    q, k = (torch.randn(D, generator=g).expand(1, 1, T, D) for _ in range(2))
    S = rotate(q, rotary_angles(T, D))[0, 0] @ rotate(k, rotary_angles(T, D))[0, 0].T
    for offset in range(-T + 1, T):
        diagonal = S.diagonal(offset)
        assert (diagonal - diagonal[0]).abs().max() < 1e-4 * S.abs().max(), offset
    assert S.diagonal(0)[0] != S.diagonal(5)[0]   # while different offsets score differently


def attention_inputs(model, x):
    """The q and k that each layer's attention received in a forward pass of x."""
    seen = []
    hooks = [block.attn.attend.register_forward_hook(lambda module, qkv, O: seen.append(qkv[:2]))
             for block in model.transformer.h]
    model(x)
    for hook in hooks:
        hook.remove()
    return seen


def test_qk_norm_gives_each_head_unit_rms_before_its_gains():
    """With QK-norm every head's q and k reach the attention at root mean square 1 per position, times the gains of
    their channels; the learned positions are still added to the tokens (GPT-2's table stays)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attn="sdpa", fix="off", qk_norm=True))
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.q_gain.uniform_(0.5, 2.0)
            block.attn.k_gain.uniform_(0.5, 2.0)
    x, _ = batch(2, 40)
    H, D = SMALL["n_head"], SMALL["n_embd"] // SMALL["n_head"]
    for block, (q, k) in zip(model.transformer.h, attention_inputs(model, x)):
        for t, gain in ((q, block.attn.q_gain), (k, block.attn.k_gain)):
            unit = t / gain.detach().view(H, 1, D)
            assert torch.allclose(unit.pow(2).mean(-1), torch.ones(()), atol=1e-3)   # 1 - eps / mean square
    assert isinstance(model.transformer.wpe, torch.nn.Embedding)
    plain = GPT(GPTConfig(**SMALL, attn="sdpa", fix="off"))
    assert sum(p.numel() for p in model.parameters()) == (sum(p.numel() for p in plain.parameters())
                                                          + 2 * SMALL["n_layer"] * SMALL["n_embd"])


def test_rope_replaces_the_position_table_and_turns_q_and_k():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL, attn="sdpa", fix="off", pos="rope"))
    assert not any(name.startswith("transformer.wpe") for name, _ in model.named_parameters())
    assert "angles" not in str(list(model.state_dict()))   # a function of the shape, not saved
    x, _ = batch(2, 40)
    (q, k), _ = attention_inputs(model, x)
    block = model.transformer.h[0]
    h = block.ln_1(model.transformer.wte(x))   # no table added: layer 0 reads the tokens alone
    q0, k0, _ = block.attn.c_attn(h).split(SMALL["n_embd"], dim=2)
    q0, k0 = (t.view(2, 40, SMALL["n_head"], -1).transpose(1, 2) for t in (q0, k0))
    from model import rotate
    assert torch.allclose(q, rotate(q0, block.attn.angles[:40]), atol=1e-6)
    assert torch.allclose(k, rotate(k0, block.attn.angles[:40]), atol=1e-6)


@pytest.mark.skipif(not kernels.INTERPRET, reason="bitwise equality holds under the interpreter")
@pytest.mark.parametrize("options", [dict(), dict(pos="rope"), dict(qk_norm=True), dict(pos="rope", qk_norm=True)])
def test_each_block_kernel_equals_its_emulation(options, monkeypatch):
    """In GPT-2's block (q, k and v views of one projection) and with rotary positions and QK-norm on, our Triton kernel
    (under the CPU interpreter) and its PyTorch emulation give the same loss and gradients bit for bit, with each
    fix, under bf16 autocast: the options change what reaches the attention, not how it rounds. The QK-norm gains'
    gradients are sums over the batch whose order follows the layout each attention returns dq and dk in: equal to
    float32's last bits."""
    import model as model_module
    x, y = batch(2, 64)
    for fix in ("off", "on", "paper"):
        results = []
        for impl in ("kernel", "emulate"):
            monkeypatch.setattr(model_module, "implementation", lambda attn, device_type, impl=impl: impl)
            torch.manual_seed(0)
            gpt = GPT(GPTConfig(**SMALL, attn="kernel", fix=fix, **options))
            with BF16:
                loss = gpt(x, y)[1]
            loss.backward()
            results.append((loss, {name: p.grad for name, p in gpt.named_parameters()}))
        (loss_k, grads_k), (loss_e, grads_e) = results
        assert torch.equal(loss_k, loss_e)
        for name, grad in grads_k.items():
            if name.endswith("_gain"):
                assert (grad - grads_e[name]).abs().max() <= 1e-6 * grad.abs().max(), name
            else:
                assert torch.equal(grad, grads_e[name]), name
