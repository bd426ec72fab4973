"""The two roundings between delta from O and delta from P, on random rows (float64 reference, ~10 s).

"fa2" numerics: P = exp(S - m) in fp32, rounded to bf16 before P V, l from the unrounded P, O cast to bf16 once.
4,096 rows of 256 keys, scores N(0, std) rounded to bf16, V ~ N(-1, 0.5) in bf16. Prints the mean (signed, with
its standard error) and the rms error of O from each rounding: P's (O before its cast less the exact O) and the
cast's (the bf16 O less O before its cast).

    python -m experiments.rounding_terms > results/mechanism/rounding_terms.txt
"""
import torch

from nanolp.runconfig import Parser

R, N, D = 4096, 256, 64  # rows, keys per row, head dim


def bf(x):
    """x rounded to bf16, back in float64."""
    return x.to(torch.bfloat16).double()


def main():
    Parser(prog="python -m experiments.rounding_terms", description=__doc__.split("\n\n")[0]).parse_args()  # no flags
    torch.manual_seed(0)
    for std in (1.0, 3.0, 10.0):
        s = bf(torch.randn(R, N, dtype=torch.float64) * std).float().double()
        v = bf(torch.randn(R, N, D, dtype=torch.float64) * 0.5 - 1.0)
        p = torch.exp((s - s.amax(1, keepdim=True)).float()).double()   # exp in fp32, as the kernel
        l = p.sum(1, keepdim=True)
        o_exact = torch.einsum("rn,rnd->rd", p, v) / l
        o_pre = torch.einsum("rn,rnd->rd", bf(p), v) / l                 # P rounded before P V, l from the unrounded P
        o = bf(o_pre.float().double())                                   # the final cast
        e_p, e_cast = o_pre - o_exact, o - o_pre
        se = lambda e: e.std() / e.numel() ** 0.5
        rms = lambda e: e.pow(2).mean().sqrt()
        print(f"logit std {std:4}: mean err O  P-term {e_p.mean():+.2e} (s.e. {se(e_p):.1e})  "
              f"cast-term {e_cast.mean():+.2e} (s.e. {se(e_cast):.1e});  rms P {rms(e_p):.1e} cast {rms(e_cast):.1e}")


if __name__ == "__main__":
    main()
