"""Is O's bf16 rounding error nearly the same vector from row to row (coherent), so that delta's error becomes a
fixed linear function of dO? On synthetic causal rows, float64 reference, seconds.

Causal rows of 256 keys, head dim 64, 64 sequences; scores = scale * q.k / sqrt(d) with q, k ~ N(0, 1) (a small
scale is a diffuse head); V = mu * (one vector per sequence) + N(0, 1), drawn as bf16 values. Per sequence, over
rows 64-255: coherence = |mean of the rounding errors r_i| / mean |r_i| (1: the same vector in every row; about
1/sqrt(192) = 0.072 for independent errors), and the mean cosine between neighbouring rows' r_i.

    python -m experiments.cast_coherence > results/mechanism/cast_coherence.txt
"""
import torch

from nanolp.runconfig import Parser

T, D, B = 256, 64, 64  # rows (keys) per sequence, head dim, sequences


def main():
    Parser(prog="python -m experiments.cast_coherence", description=__doc__.split("\n\n")[0]).parse_args()  # no flags
    torch.manual_seed(0)
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    print(f"{B} sequences of {T} rows, head dim {D}; "
          f"independent errors would give coherence {(T - T // 4) ** -0.5:.3f}")
    for mu in (0.0, 1.0, 3.0):
        for scale in (0.1, 1.0, 4.0):
            q, k = torch.randn(2, B, T, D, dtype=torch.float64)
            v = (mu * torch.randn(B, 1, D) + torch.randn(B, T, D)).bfloat16().double()
            p = (scale * q @ k.transpose(-1, -2) / D**0.5).masked_fill(causal, float("-inf")).softmax(-1)
            o = p @ v
            r = (o.bfloat16().double() - o)[:, T // 4:]  # the first rows have few keys to average
            coherence = (r.mean(1).norm(dim=-1) / r.norm(dim=-1).mean(1)).mean().item()
            neighbour = torch.nn.functional.cosine_similarity(r[:, 1:], r[:, :-1], dim=-1).mean().item()
            print(f"V's common part mu {mu:3.1f}, logit scale {scale:3.1f}: coherence {coherence:.3f}, "
                  f"neighbouring rows' cosine {neighbour:+.3f}")


if __name__ == "__main__":
    main()
