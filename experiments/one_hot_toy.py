"""Does delta's error from O's final cast grow the attention weights in a toy whose rows are one-hot? (CPU)

    python -m experiments.one_hot_toy off 0 40000      # ~30 min on one core
    python -m experiments.one_hot_toy dfp32 0 40000

One attention layer (the repo's GPT: 1 layer, 1 head, 32 dims, context 32, vocab 32) learns to output the previous
token, so every row but the first puts all its weight on one key: the sharp rows where O's bf16 cast rounds O back
to that key's V (experiments/sharp_rows.py). Attention is the kernel's numerics (nanolp.emulate, bf16 autocast, fix
off), with delta from the bf16 O ("off") or from the fp32 O ("dfp32", --delta fp32-o); AdamW (0.9, 0.95), lr 3e-3, no
weight decay, batch 32. The loss reaches its floor, log(32)/32 = 0.108 (the first position cannot be predicted), within
~1,000 steps; after that the printed product of W_Q's and W_K's spectral norms bounds the logits' growth. The CPU
is deterministic, so the two arms differ only through delta."""
import torch

from kernels import Numerics
from model import GPT, GPTConfig
from nanolp.runconfig import Parser

VOCAB, T, B, WIDTH = 32, 32, 32, 32


def main(arm, seed, steps, every=4000):
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=T, n_layer=1, n_head=1, n_embd=WIDTH, attn="emulate",
                          fix="off", numerics=Numerics(delta="fp32-o" if arm == "dfp32" else "o")))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    print("step loss |W_Q|*|W_K|", flush=True)
    for step in range(steps + 1):
        tokens = torch.randint(VOCAB, (B, T + 1), generator=g)
        x, y = tokens[:, 1:].contiguous(), tokens[:, :-1].contiguous()   # y at t is x at t - 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % every == 0:
            W_q, W_k, _ = model.transformer.h[0].attn.c_attn.weight.float().chunk(3, dim=0)
            norms = torch.linalg.matrix_norm(W_q, 2) * torch.linalg.matrix_norm(W_k, 2)
            print(f"{step} {loss.item():.4f} {norms.item():.2f}", flush=True)


if __name__ == "__main__":
    p = Parser(prog="python -m experiments.one_hot_toy", description=__doc__.split("\n\n")[0])
    p.add_argument("arm", choices=("off", "dfp32"), help="delta from the bf16 O (off) or the fp32 O (dfp32)")
    p.add_argument("seed", type=int)
    p.add_argument("steps", type=int)
    args = p.parse_args()
    main(args.arm, args.seed, args.steps)
