"""O's bf16 cast in rows where one key takes nearly all the weight (synthetic rows, float64 reference, ~30 s).

A memorised model makes rows where one key has p_max = 1 - eps. Then O = V_max + eps * (V_rest - V_max); when
eps * |V_rest - V_max| is below half a bf16 step, O rounds back to V_max, delta = rowsum(dO * O) loses exactly the
eps term, and delta's error equals the exact gradient of the dominant logit, dS_max = p_max * (dO.V_max - dO.O):
not noise, a copy of a gradient. Per eps: how often O rounds back to V_max, and how well delta's error tracks
dS_max (correlation, sign agreement, least-squares slope).

    python -m experiments.sharp_rows > results/mechanism/sharp_rows.txt
"""
import torch

from nanolp.runconfig import Parser

T, D, ROWS = 256, 64, 20000  # keys per row and head dim of the default preset


def main():
    Parser(prog="python -m experiments.sharp_rows", description=__doc__.split("\n\n")[0]).parse_args()  # takes no flags
    torch.manual_seed(0)
    print(f"{ROWS} rows of {T} keys, head dim {D}; V and the exact O in float64, V drawn as bf16 values")
    for eps in (1e-4, 1e-3, 4e-3, 1e-2, 3e-2, 1e-1):
        v = torch.randn(ROWS, T, D).bfloat16().double()
        rest = torch.rand(ROWS, T - 1, dtype=torch.float64)
        p = torch.cat([torch.full((ROWS, 1), 1 - eps, dtype=torch.float64),
                       eps * rest / rest.sum(-1, keepdim=True)], -1)
        o = torch.einsum("rt,rtd->rd", p, v)
        o_bf16 = o.bfloat16().double()                          # the kernel's final cast (round to nearest even)
        do = torch.randn(ROWS, D, dtype=torch.float64)
        delta_err = (do * (o_bf16 - o)).sum(-1)                 # delta from the bf16 O minus delta from the exact O
        ds_max = p[:, 0] * ((do * v[:, 0]).sum(-1) - (do * o).sum(-1))  # exact gradient of the dominant logit
        snapped = (o_bf16 == v[:, 0]).all(-1).double().mean().item()
        corr = torch.corrcoef(torch.stack([delta_err, ds_max]))[0, 1].item()
        same = ((delta_err > 0) == (ds_max > 0)).double().mean().item()
        slope = ((delta_err * ds_max).sum() / (ds_max * ds_max).sum()).item()
        print(f"1 - p_max {eps:6.0e}: O rounds back to V_max in {snapped:6.1%} of rows; "
              f"corr(delta error, dS_max) {corr:+.3f}, same sign {same:6.1%}, slope {slope:+.3f}")


if __name__ == "__main__":
    main()
