"""
A small GPT in the style of nanoGPT: learned positions, pre-LayerNorm blocks, a GELU MLP and an output
layer tied to the token embedding (GPT-2's block; rotary positions and QK-norm, a modern block's, are options).
The one thing that differs is that the attention inside every block is pluggable, because the attention numerics
are what this project studies:

    kernel      our Triton FlashAttention-2 kernel (kernels.py); on CPU tensors its PyTorch emulation
    emulate     the tile-by-tile PyTorch emulation (nanolp/emulate.py), with the kernel's rounding points
    sdpa        torch.nn.functional.scaled_dot_product_attention, whichever backend torch picks
    sdpa-flash  SDPA forced to its FlashAttention backend
    sdpa-cudnn  SDPA forced to its cuDNN backend
    fp32        plain softmax attention in float32: the control with no low-precision attention at all

GPTConfig's second block holds the experiments (variants of our kernel's numerics, kernels.Numerics, and the
block: positions learned, rotary or none, QK-norm); the demo leaves them at their defaults.
"""

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kernels import Numerics, flash_attention
from nanolp.emulate import OURS, causal_scores, emulate_attention, kernel_only   # the kernel's emulation and its rule

ATTN_BACKENDS = ("kernel", "emulate", "sdpa", "sdpa-flash", "sdpa-cudnn", "fp32")
POSITIONS = ("learned", "rope", "none")
ROPE_BASE = 10000.0   # rotary positions' wavelengths run from 2 pi tokens to just under 2 pi * ROPE_BASE (RoFormer's)


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 256
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    attn: str = "kernel"      # one of ATTN_BACKENDS
    # kernel/emulate: "off", "on" (delta from the fp32 O) or "paper" (the paper's rule), kernels.flash_attention's
    # fix; no default: the caller's (train.py's --fix)
    fix: str = field(kw_only=True)
    # ---- experiments: variants that test the mechanism; the defaults are the plain model and attention.
    numerics: Numerics = Numerics()   # kernel/emulate: how our attention rounds
    pos: str = "learned"      # "learned" positions (GPT-2), "rope" (rotary: q and k turned by their position, as
                              # LLaMA, Qwen and OLMo do) or "none": then layer 0 sees only tokens, so every repeat
                              # of a row's best-matching token ties exactly (copies, which carry no bias)
    qk_norm: bool = False     # RMSNorm on each head's q and k, a learned gain per channel (OLMo 2, Qwen3, Gemma 3)


def reference_attention(q, k, v):
    """Softmax attention in float32 from the same q, k, v; only the result is cast back to their dtype.
    Autograd's softmax backward never reads the output O, so this path has no delta = rowsum(dO * O) error."""
    P = causal_scores(q, k).softmax(dim=-1)
    with torch.autocast(q.device.type, enabled=False):
        return (P @ v.float()).to(q.dtype)


def implementation(attn, device_type):
    """The backend that computes attn on a device: our Triton kernel needs CUDA, so anywhere else attn "kernel"
    runs its PyTorch emulation, which has the kernel's numerics but not its code (nanolp/emulate.py)."""
    return "emulate" if attn == "kernel" and device_type != "cuda" else attn


def attention(q, k, v, config):
    """Causal attention on (batch, heads, seq, head_dim) tensors with the backend the config names."""
    if config.attn in OURS:
        if implementation(config.attn, q.device.type) == "kernel":
            fn = flash_attention
        else:  # the emulation has the kernel's numerics and runs anywhere
            fn = emulate_attention
        return fn(q, k, v, causal=True, fix=config.fix, numerics=config.numerics)
    if config.attn == "fp32":
        return reference_attention(q, k, v)
    if config.attn == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[config.attn]
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attend(nn.Module):
    """attention() as a module of its own, so that diagnostics can hook its inputs q, k, v and its output O."""

    def __init__(self, config):
        super().__init__()
        self.config = config

    def forward(self, q, k, v):
        return attention(q, k, v, self.config)


class CausalSelfAttention(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # rows: W_Q, then W_K, then W_V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.attend = Attend(config)
        self.qk_norm, self.rope = config.qk_norm, config.pos == "rope"
        if self.qk_norm:   # a gain per channel of q and of k, so each head has its own
            self.q_gain, self.k_gain = (nn.Parameter(torch.ones(config.n_embd)) for _ in range(2))
        if self.rope:      # not saved: a function of the shape
            self.register_buffer("angles", rotary_angles(config.block_size, config.n_embd // config.n_head),
                                 persistent=False)

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if self.qk_norm:   # normalise, then turn: a rotation keeps the norm
            q, k = rms_norm(q, self.q_gain), rms_norm(k, self.k_gain)
        if self.rope:
            q, k = rotate(q, self.angles[:T]), rotate(k, self.angles[:T])
        y = self.attend(q, k, v)  # (B, n_head, T, head_dim): the scores it forms are the logits diagnostics read
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


def rms_norm(x, gain, eps=1e-6):
    """QK-norm: each head's vector x (B, n_head, T, head_dim) scaled to unit root mean square, then times its
    channels' gains (n_embd = n_head * head_dim). The logits are then at most gain_q * gain_k * sqrt(head_dim): only
    the gains can make them grow. Computed in float32 and cast back, as autocast does for its norms."""
    B, H, T, D = x.shape
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * gain.float().view(H, 1, D)).to(x.dtype)


def rotary_angles(T, head_dim):
    """Rotary positions' angles, (T, head_dim / 2): position t turns channel pair j by t * ROPE_BASE^(-2j/head_dim)."""
    inv_freq = ROPE_BASE ** -(torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    return (torch.arange(T, dtype=torch.float64)[:, None] * inv_freq).float()


def rotate(x, angles):
    """Rotary positions: turn each pair of channels (j, j + head_dim / 2) of x (B, n_head, T, head_dim) by its
    position's angle, so that q_m . k_n depends on the positions only through m - n. In float32, cast back."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        assert config.attn in ATTN_BACKENDS, f"attn must be one of {ATTN_BACKENDS}, got {config.attn!r}"
        assert config.pos in POSITIONS, f"pos must be one of {POSITIONS}, got {config.pos!r}"
        if given := kernel_only(config.attn, dict(fix=config.fix) | asdict(config.numerics)):
            raise ValueError(f"{', '.join(given)}: only our kernel (attn kernel or emulate) has it, "
                             f"not attn {config.attn!r}")
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd) if config.pos == "learned" else nn.Identity(),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied: one matrix reads and writes tokens
        self.apply(self._init_weights)
        # GPT-2: scale the layers that write into the residual stream so its variance does not grow with depth
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        B, T = idx.size()
        assert T <= self.config.block_size, f"sequence of {T} tokens, block_size is {self.config.block_size}"
        x = self.transformer.wte(idx)
        if self.config.pos == "learned":
            x = x + self.transformer.wpe(torch.arange(T, device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.view(-1))
        return logits, loss

    def flops_per_token(self):
        """Training FLOPs per token, as in PaLM (appendix B) and nanoGPT: 6N for the weight matmuls
        (forward 2N, backward 4N) plus 12 * n_layer * n_embd * T for the attention scores and P V.
        N leaves out the position table (a lookup, not a matmul); the tied embedding counts once, as the
        output layer. The attention term ignores causal masking, as PaLM does."""
        c = self.config
        n = sum(p.numel() for name, p in self.named_parameters() if not name.startswith("transformer.wpe"))
        return 6 * n + 12 * c.n_layer * c.n_embd * c.block_size
