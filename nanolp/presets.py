"""The presets and what a run's arm is, shared by train.py (which runs them) and analyze.py (which names runs
by the train.py flags that set them apart)."""
from dataclasses import asdict, fields

from kernels import Numerics

# The attention's numerics (kernels.Numerics): a run holds each field as a setting of its own (a flag, a key of
# config.json and summary.json).
NUMERICS = tuple(f.name for f in fields(Numerics))
COMMON = dict(
    fix="off", attn="kernel", **asdict(Numerics()), pos="learned", seed=0,
    lr=1e-3, warmup=100, beta1=0.9, beta2=0.95, weight_decay=0.0, grad_clip=1.0,
    steps=5000, minutes=None, dtype="bf16",
    log_interval=10, eval_interval=250, eval_iters=20, diag_interval=250, ckpt_interval=250,
    out="runs", data=None,
)
PRESETS = {
    # The demo: plain bf16 on TinyShakespeare, the paper's setting at a size where the failure comes within
    # minutes on one GPU (how it was chosen: results/default_search/). The model memorises the text (train loss
    # ~0.05) and then trains on near-zero gradients; there the one-signed error that O's final bf16 cast puts
    # into delta = rowsum(dO * O) grows layer 0's W_Q and logits until the loss blows up. Fix off, seed 0 went
    # non-finite at step 94,798 (10.3 training minutes on one H200 with CUDA graphs), and each of seeds 0-7
    # collapsed (steps 64,890-141,554). --fix on trained 152,000 steps on seed 0 with layer 0's max logit at
    # 9.3-13.7; --fix paper collapsed on seeds 0 and 1 (steps 69,890 and 121,201).
    "default": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, steps=200_000,
                    eval_interval=1000, diag_interval=1000, ckpt_interval=5000),
    # GPT-2 small's shape, the paper's (124M with GPT-2's vocabulary; ours is the text's characters)
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, block_size=1024, batch_size=64, steps=10000),
    # a CPU smoke run
    "tiny": dict(n_layer=2, n_head=2, n_embd=64, block_size=64, batch_size=16, lr=3e-3, warmup=20, steps=300,
                 eval_interval=100, eval_iters=4, diag_interval=50, ckpt_interval=100),
}
# --fix: off; on, the complete fix (the paper's shift and delta from the fp32 O); paper, the paper's rule alone
FIX = {"off": False, "on": True, "paper": "paper"}
# The arm: every setting that decides a run's numbers (its numerics and its data order). The default name spells
# out each one that differs from the preset, --resume refuses to change any, summary.json records them all.
# Not in it: the run's length and intervals, and --device/--compile (where and how fast the same steps run).
ARM = ("preset", "attn", "fix", *NUMERICS, "pos", "lr", "warmup", "beta1", "beta2", "weight_decay", "grad_clip",
       "n_layer", "n_head", "n_embd", "block_size", "batch_size", "dtype", "data", "seed")
NAMED = ("preset", "attn", "fix", "seed")  # always in the name


def changed_settings(c):
    """The settings of ARM, other than the NAMED ones, in which config c differs from its preset."""
    preset = {**COMMON, **PRESETS.get(c.get("preset"), {})}   # (an old run's preset may be gone)
    return {k: c.get(k) for k in ARM if k not in NAMED and c.get(k) != preset.get(k)}
