"""Which rounding of a bf16 flash forward pushes W_Q and W_K outward, on a model that has memorised its text? (CPU)

    mkdir -p data/ts32 && head -c 34856 data/tinyshakespeare/input.txt > data/ts32/input.txt   # 1/32 of the text
    python train.py --preset tiny --attn sdpa --dtype fp32 --data data/ts32/input.txt --n-layer 4 --n-head 4 \\
        --n-embd 128 --block-size 128 --batch-size 32 --steps 3000 --lr 1e-3 --out /tmp/pushrun --name m
    python -m experiments.push_split /tmp/pushrun/m 40 > results/mechanism/push_split.txt
                                                             # ~4 minutes on 2 cores (training: ~15)

For each of `batches` training batches, every layer's q, k, v and dO are captured under bf16 autocast
(nanolp.diagnostics.capture_attention); the kernel's "fa2" forward (nanolp.emulate, fix off) gives O in bf16 and
O before its cast (fp32); nanolp.diagnostics' fp32 attention is the reference. delta's error splits into P's
rounding (O before the cast minus the reference) and O's cast (bf16 O minus O before the cast); each term's push
(nanolp.diagnostics' delta_push: positive grows |W_Q|^2 + |W_K|^2) is averaged over the batches with its t
statistic (mean over its standard error): a term that keeps one sign across batches has |t| >> 2. For scale, the
exact gradient's own push, -<dq, q> per row, is printed beside them."""
import json
from pathlib import Path

import torch

from model import GPT, GPTConfig
from nanolp import emulate
from nanolp.emulate import causal_scores
from nanolp.data import DEFAULT_TEXT, get_batch, prepare
from nanolp.diagnostics import attention_stats, capture_attention
from nanolp.runconfig import Parser
from nanolp.runs import latest_checkpoint


def pushes(q, k, v, dO):
    """Per head: the push of P's rounding, of O's cast, and the exact gradient's own push. The first two are
    nanolp.diagnostics' delta_push of O before its cast, and of the bf16 O less that."""
    o, o32, _ = emulate.forward(q, k, v, True, False)
    *_, push_p = attention_stats(q, k, v, o32, dO)
    *_, push_all = attention_stats(q, k, v, o, dO)
    S = causal_scores(q, k).double()
    P = S.softmax(dim=-1)
    dO, v = dO.double(), v.double()
    dS = P * (dO @ v.transpose(-2, -1) - (dO * (P @ v)).sum(-1, keepdim=True))
    true_push = -(dS * S.nan_to_num(neginf=0.0)).sum(-1).mean(dim=(0, 2))  # -<dq, q> a row (= -<dk, k>); float64
    return push_p, push_all - push_p, true_push


def main(run_dir, batches=40):
    c = json.loads((Path(run_dir) / "config.json").read_text())
    data = prepare(c["data"] or DEFAULT_TEXT)   # (none recorded: TinyShakespeare, whatever $NANOLP_DATA says now)
    model = GPT(GPTConfig(vocab_size=data.vocab_size, block_size=c["block_size"], n_layer=c["n_layer"],
                          n_head=c["n_head"], n_embd=c["n_embd"], pos=c.get("pos", "learned"),
                          qk_norm=c.get("qk_norm", False), attn="sdpa", fix="off"))
    ckpt = latest_checkpoint(run_dir)
    model.load_state_dict(torch.load(ckpt, map_location="cpu")["model"])
    print(f"{ckpt}: {batches} batches of {c['batch_size']} x {c['block_size']}")
    ctx = torch.autocast("cpu", dtype=torch.bfloat16)
    per_batch = []  # [batch][layer] -> (push_p, push_cast, true) each (heads,)
    for b in range(batches):
        x, y = get_batch(data.train.long(), c["batch_size"], c["block_size"], seed=12345, step=b)
        per_batch.append([pushes(q, k, v, dO) for q, k, v, _, dO in capture_attention(model, x, y, ctx)])
    for layer in range(c["n_layer"]):
        stacked = [torch.stack([per_batch[b][layer][term] for b in range(batches)]) for term in range(3)]
        for h in range(c["n_head"]):
            cells = []
            for name, t in zip(("P rounding", "O cast"), stacked[:2]):
                mean, se = t[:, h].mean(), t[:, h].std() / batches ** 0.5
                cells.append(f"{name} {mean:+.2e} (t {mean / se:+6.1f})")
            print(f"L{layer} H{h}: " + "   ".join(cells) + f"   exact gradient's push {stacked[2][:, h].mean():+.2e}")


if __name__ == "__main__":
    p = Parser(prog="python -m experiments.push_split", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a trained run's folder (config.json and a checkpoint)")
    p.add_argument("batches", type=int, nargs="?", default=40)
    args = p.parse_args()
    if not (args.run_dir / "config.json").is_file() or latest_checkpoint(args.run_dir) is None:
        p.error(f"{args.run_dir} holds no run with a checkpoint (config.json and ckpt/step_*.pt)")
    main(args.run_dir, args.batches)
