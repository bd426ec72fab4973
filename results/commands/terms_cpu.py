"""Session 7, CPU: the two roundings between delta from O and delta from P, on random rows (float64 reference).
"fa2" numerics: P = exp(S - m) in fp32, rounded to bf16 before P V, l from the unrounded P, O cast to bf16 once.
4,096 rows of 256 keys, scores N(0, std) rounded to bf16, V ~ N(-1, 0.5) in bf16. Prints the mean (signed) and
RMS error of O from each rounding. Run: python results/commands/terms_cpu.py (seconds)."""
import torch
torch.manual_seed(0)
R, N, D = 4096, 256, 64
def bf(x): return x.to(torch.bfloat16).double()
for std in [1.0, 3.0, 10.0]:
    s = torch.randn(R, N, dtype=torch.float64) * std
    s = bf(s).float().double()
    v = bf(torch.randn(R, N, D, dtype=torch.float64) * 0.5 - 1.0)
    m = s.amax(1, keepdim=True)
    p = torch.exp((s - m).float()).double()         # fp32 exp
    l = p.sum(1, keepdim=True)
    o_true = torch.einsum("rn,rnd->rd", p, v) / l
    o_pre = torch.einsum("rn,rnd->rd", bf(p), v) / l     # P rounded before P V, l from unrounded P
    o = bf(o_pre.float().double())
    eP = o_pre - o_true; eC = o - o_pre
    print(f"logit std {std:4}: mean err O  P-term {eP.mean():+.2e} (s.e. {eP.std()/eP.numel()**.5:.1e})  cast-term {eC.mean():+.2e} (s.e. {eC.std()/eC.numel()**.5:.1e});  rms P {eP.pow(2).mean().sqrt():.1e} cast {eC.pow(2).mean().sqrt():.1e}")
