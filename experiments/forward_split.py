"""Where the fix's forward time goes: the forward alone with the fix off, the shift alone (fix="paper"), the fp32
O alone (delta_fp32) and both (fix=True), at seq 4096, batch 4, 2048 channels, bf16, causal; median ms.

    python -m experiments.forward_split > results/speed/forward_split.txt     # on a GPU
"""
import torch
from triton.testing import do_bench

from kernels import Numerics, flash_attention

VARIANTS = {"off": {}, "shift": dict(fix="paper"), "o32": dict(numerics=Numerics(delta_fp32=True)),
            "both": dict(fix=True)}


def main():
    for D in (64, 128):
        N, B, H = 4096, 4, 2048 // D
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
        for name, options in VARIANTS.items():
            ms = do_bench(lambda: flash_attention(q, k, v, **options), return_mode="median")
            print(D, name, f"fwd {ms:.3f} ms")


if __name__ == "__main__":
    main()
