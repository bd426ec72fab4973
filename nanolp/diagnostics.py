"""
What the paper's mechanism says to watch, measured on one fixed batch every --diag-interval steps (never per step);
the names are log.csv's columns, and why each is watched: docs/findings.md, section 12.

    max_logit   largest scaled score q.k/sqrt(d) in a layer
    tie_rate    fraction of causal rows with >= 2 scores within TIE_TOL of the row max: where P rounds to 1.0
                (TIE_TOL widened like the fix's when the amplifier rounds P to fewer bits; the scores rounded
                to bf16 as the kernel rounds them in the "autocast" precision); also per head
    sharp_rate  fraction of causal rows (the first query, with its one key, left out) whose largest probability
                exceeds 1 - SHARP_EPS; per layer and per head
    sn_q, sn_k  spectral norms of W_Q and W_K (and of each head's slice of W_Q)
    delta_err   mean of rowsum(dO * O) - rowsum(dO * O_fp32): the signed error that reaches dQ and dK
                (O is what the configured attention returned, O_fp32 is float32 attention on the same q, k, v)
    delta_push  mean of that error times the row's attention-weighted logit E_P[S] = sum_j P_j S_j: how fast
                the error grows W_Q and W_K

and, on more rows (PROBE_BATCHES batches of the training batch size, layer PROBE_LAYER), the error delta reads,
split as the curvature hypothesis splits it (delta_probe; docs/findings.md, section 4):
    probe_total   rowsum(dO * e), e = O - O_fp32 the error of O's final cast, dO from the model as it runs
    probe_lin     rowsum(dO_clean * e), dO_clean from a forward in which O stays in fp32 downstream of the layer
    probe_curv    rowsum((dO_z - dO_clean) * z) for noise z of round-to-nearest's size (uniform within half a
                  bf16 step of O_fp32), independent of e: an estimate of tr(H Sigma_e)
    probe_indep   rowsum(dO * e'), e' an independent stochastic rounding error of O_fp32
    each with its standard error (_se) over the probe's rows; the noise of curv and indep drawn from a seed that
    train.py sets to the step.
"""

import dataclasses
import math

import torch
import torch.nn.functional as F

from kernels import TIE_TOL, amplified_v, stochastic_round, widening   # TIE_TOL: exp(-x) rounds to 1.0
from nanolp.emulate import causal_scores, emulate_forward_fp32, scores

SHARP_EPS = 1e-3  # below it, delta's error from O's cast copies the dominant logit's gradient
PROBE_LAYER = 0    # the layer that runs away
LOGIT = f"max_logit_L{PROBE_LAYER}"   # its max attention logit, log.csv's column that the figures and the bar follow
PROBE_BATCHES = 4  # batches of the training batch size: ~4e5 rows at the default preset
PROBE_TERMS = ("total", "lin", "curv", "indep")


def diag_columns(n_layer, n_head, qk_norm=False):
    """log.csv's diagnostic columns, in order: per layer seven numbers (nine with QK-norm: its largest q and k
    gains, which bound the logits), then five per head."""
    columns = []
    for i in range(n_layer):
        columns += [f"max_logit_L{i}", f"tie_rate_L{i}", f"sharp_rate_L{i}", f"sn_q_L{i}", f"sn_k_L{i}",
                    f"delta_err_L{i}", f"delta_push_L{i}"] + ([f"gain_q_L{i}", f"gain_k_L{i}"] if qk_norm else [])
        for h in range(n_head):
            columns += [f"sn_q_L{i}_H{h}", f"tie_rate_L{i}_H{h}", f"sharp_rate_L{i}_H{h}", f"delta_err_L{i}_H{h}",
                        f"delta_push_L{i}_H{h}"]
    return columns + probe_columns()


def probe_columns():
    return [f"probe_{term}{se}_L{PROBE_LAYER}" for term in PROBE_TERMS for se in ("", "_se")]


def hooked_loss(model, x, y, ctx, hooks):
    """The loss of the batch (x, y) with the given forward hooks in place; they are removed afterwards."""
    try:
        with ctx:
            return model(x, y)[1]
    finally:
        for hook in hooks:
            hook.remove()


def capture_attention(model, x, y, ctx):
    """One forward and backward of the batch (x, y) that records, for every layer's attention call,
    its inputs q, k, v, its output O and the gradient dO of the loss with respect to O.
    dO comes from torch.autograd.grad, so the parameters' .grad are left untouched."""
    calls = []
    loss = hooked_loss(model, x, y, ctx, [block.attn.attend.register_forward_hook(
        lambda module, qkv, O: calls.append((*qkv, O))) for block in model.transformer.h])
    dOs = torch.autograd.grad(loss, [O for *_, O in calls])
    return [(q.detach(), k.detach(), v.detach(), O.detach(), dO) for (q, k, v, O), dO in zip(calls, dOs)]


@torch.no_grad()
def attention_stats(q, k, v, O, dO, tol=TIE_TOL, precision="fa2"):
    """max_logit, and per head the tie rate (ties within tol nats), the sharp rate, the delta error and its push,
    of one attention call. Ties are counted in the scores the kernel exponentiates: in the "autocast" precision they
    are rounded to bf16, which ties keys whose fp32 scores differ by up to half a bf16 step (1/32 at logits 8-16)."""
    S = causal_scores(q, k)  # fp32, -inf above the diagonal
    S_kernel = S if precision == "fa2" else scores(q, k, precision, q.dtype).masked_fill(S.isneginf(), -math.inf)
    kernel_max = S_kernel.amax(dim=-1, keepdim=True)
    tied = (S_kernel >= kernel_max - tol).sum(dim=-1) >= 2  # -inf entries never count: the row max is finite
    P = S.softmax(dim=-1)
    sharp = P[:, :, 1:].amax(dim=-1) > 1 - SHARP_EPS  # query 0 has one key: P = 1 exactly, O = V, nothing to round
    expected_logit = (P * S.nan_to_num(neginf=0.0)).sum(dim=-1)  # masked entries have P = 0
    delta_lp = (dO.float() * O.float()).sum(dim=-1)
    delta_fp32 = (dO.float() * (P @ v.float())).sum(dim=-1)
    err = delta_lp - delta_fp32
    return (S.amax(), tied.float().mean(dim=(0, 2)), sharp.float().mean(dim=(0, 2)), err.mean(dim=(0, 2)),
            (err * expected_logit).mean(dim=(0, 2)))


@torch.no_grad()
def spectral_norms(model):
    """Largest singular value of W_Q and W_K per layer, and of each head's rows of W_Q, in float32; with QK-norm,
    where W_Q's scale no longer reaches the logits, also the largest |gain| of q and of k per layer."""
    n_head = model.config.n_head
    out = {}
    for i, block in enumerate(model.transformer.h):
        if block.attn.qk_norm:
            out[f"gain_q_L{i}"], out[f"gain_k_L{i}"] = (g.detach().float().abs().max()
                                                        for g in (block.attn.q_gain, block.attn.k_gain))
        W_q, W_k, _ = block.attn.c_attn.weight.float().chunk(3, dim=0)  # each (n_embd out, n_embd in)
        out[f"sn_q_L{i}"] = torch.linalg.matrix_norm(W_q, ord=2)
        out[f"sn_k_L{i}"] = torch.linalg.matrix_norm(W_k, ord=2)
        per_head = torch.linalg.matrix_norm(W_q.view(n_head, -1, W_q.size(1)), ord=2)
        out.update({f"sn_q_L{i}_H{h}": sn for h, sn in enumerate(per_head)})
    return out


def fp32_output(q, k, v, config):
    """The attention's O before its final cast, as config's attention computes it (float32 attention for the
    torch backends, which have no fp32 O of their own to read)."""
    if config.attn == "kernel" and q.is_cuda:   # the fp32 O the kernel keeps for delta with delta "fp32-o"
        from kernels import forward
        numerics = dataclasses.replace(config.numerics, delta="fp32-o")
        with torch.no_grad():
            return forward(q, k, amplified_v(v, numerics.o_bits), fix=config.fix, numerics=numerics).o_delta
    if config.attn in ("kernel", "emulate"):
        return emulate_forward_fp32(q, k, v, fix=config.fix, numerics=config.numerics)
    with torch.no_grad():
        return causal_scores(q, k).softmax(dim=-1) @ v.float()


def bf16_step(x):
    """The spacing of bfloat16 numbers at x (0 where x is 0)."""
    mantissa, exponent = torch.frexp(x)              # |x| in [2^(e-1), 2^e): bf16's step there is 2^(e-8)
    return torch.where(x == 0, 0.0, torch.ldexp(torch.ones_like(x), exponent - 8))


def _probe_pass(model, x, y, ctx, layer, replace=None):
    """Forward and backward of (x, y) that returns the layer's attention (q, k, v, O) and dO. With replace
    (an fp32 tensor in O's shape), the layer's attention output is replaced by it and the layer's output
    projection runs in fp32, so that what follows the layer sees the fp32 values, not their bf16 rounding."""
    block = model.transformer.h[layer].attn
    seen = {}

    def on_attend(module, qkv, O):
        seen["qkv"] = [t.detach() for t in qkv]
        seen["O"] = O if replace is None else replace.requires_grad_()
        return seen["O"]

    def on_proj(module, inputs, output):
        with torch.autocast(inputs[0].device.type, enabled=False):
            return F.linear(inputs[0].float(), module.weight.float(), module.bias.float())

    hooks = [block.attend.register_forward_hook(on_attend)]
    if replace is not None:
        hooks.append(block.c_proj.register_forward_hook(on_proj))
    (dO,) = torch.autograd.grad(hooked_loss(model, x, y, ctx, hooks), [seen["O"]])
    return (*seen["qkv"], seen["O"].detach()), dO.float()


def delta_probe(model, batches, ctx, seed=0):
    """The probe_* columns (see the top of this file) over the batches [(x, y), ...]: means and standard errors
    of the four terms, over every (batch row, head, query) of layer PROBE_LAYER (the log's columns name it)."""
    layer = PROBE_LAYER
    generator = torch.Generator(device=batches[0][0].device).manual_seed(seed)
    terms = {term: [] for term in PROBE_TERMS}
    for x, y in batches:
        (q, k, v, O), dO = _probe_pass(model, x, y, ctx, layer)
        o32 = fp32_output(q, k, v, model.config).float()
        e = O.float() - o32
        step = bf16_step(o32)
        z = (torch.rand(o32.shape, generator=generator, device=o32.device) - 0.5) * step
        _, dO_clean = _probe_pass(model, x, y, ctx, layer, replace=o32.clone())
        _, dO_noisy = _probe_pass(model, x, y, ctx, layer, replace=o32 + z)
        with torch.no_grad():
            terms["total"].append((dO * e).sum(-1))
            terms["lin"].append((dO_clean * e).sum(-1))
            terms["curv"].append(((dO_noisy - dO_clean) * z).sum(-1))
            terms["indep"].append((dO * (stochastic_round(o32, generator).float() - o32)).sum(-1))
    out = {}
    for term, values in terms.items():
        out[f"probe_{term}_L{layer}"], out[f"probe_{term}_se_L{layer}"] = mean_and_se(values)
    return out


def mean_and_se(values):
    """The mean of every element of the tensors `values` and its standard error (the sample's standard deviation
    over the square root of its size), in float32."""
    values = torch.cat([t.flatten() for t in values]).double()
    return values.mean().float(), (values.std() / math.sqrt(values.numel())).float()


def diagnose(model, x, y, ctx, probe=None, seed=0):
    """Every diagnostic column for the (uncompiled) model on the batch (x, y), and delta_probe's on the batches
    probe (default: that batch) with its noise drawn from seed, as Python floats. ctx is the autocast context of
    training, so attention sees the same dtypes as in a training step."""
    out = spectral_norms(model)
    out.update(delta_probe(model, probe or [(x, y)], ctx, seed=seed))
    numerics = model.config.numerics
    tol = TIE_TOL * widening(numerics.p_bits)                # the tie band: scores whose P rounds to 1.0
    for i, (q, k, v, O, dO) in enumerate(capture_attention(model, x, y, ctx)):
        v = amplified_v(v, numerics.o_bits)                  # the V attention read
        max_logit, *per_head = attention_stats(q, k, v, O, dO, tol, numerics.precision)
        out[f"max_logit_L{i}"] = max_logit
        for name, values in zip(("tie_rate", "sharp_rate", "delta_err", "delta_push"), per_head):
            out[f"{name}_L{i}"] = values.mean()
            out.update({f"{name}_L{i}_H{h}": value for h, value in enumerate(values)})
    names = list(out)
    values = torch.stack([out[n] for n in names]).tolist()  # one device-to-host copy for all of them
    return dict(zip(names, values))
