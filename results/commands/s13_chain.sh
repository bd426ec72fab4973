#!/bin/bash
# Session 13, as run (9, 9 and 9.3 minutes on nvidia-h200-x2: jobs 1 and 2 ran; research.md, session 13): the
# fourth installment of issue 7's seed study at the default. After session 12: fix off 6 of 6 seeds collapsed
# (64,890-141,554 steps), lse64 2 of 2, fix on 2 of 2; fp32 reference attention 0 of 3 (61,191-91,457 steps, layer
# 0 at most 1.65x its step-10,000 value), o32 0 of 2, delta from P 0 of 1; torch SDPA flash 0 of 2 by the loss, its
# layer-0 logits running away like ours.
# Jobs in order of priority, one per GPU, two seeds side by side on each (two to a GPU reach ~90,000-145,000
# steps each in three calls): with one GPU only the first runs, with two the first two, and so on (device time is
# counted per machine, not per GPU, so take the largest kind `status` lists).
#   1. ours, fix off, seeds 6 and 7 (the issue's 8 seeds)
#   2. ours in the "paper" precision mode, fix off, seeds 0 and 1 (a control the issue names; never run at the default)
#   3. torch SDPA's default backend, seeds 0 and 1 (sdpa_backend.txt says which backend it picks at this shape)
#   4. torch SDPA flash, seeds 2 and 3        5. fp32 reference attention, seeds 3 and 4
#   6. ours, fix on, seeds 2 and 3            7. SDPA default, seeds 2 and 3        8. "paper" mode, seeds 2 and 3
# Call it three times back to back on one held machine (nvidia-h200-x2 if lent, else nvidia-h200), carry
# ["data"]: `bash results/commands/s13_chain.sh 9`, again with 9, then 9.3. Each call resumes what is unfinished.
. results/commands/chain_setup.sh "$@"
python - > $OUT/sdpa_backend.txt 2>&1 <<'PY' || true
import torch
from torch.nn.attention import SDPBackend
q = torch.randn(64, 6, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)  # the default's shape
print("torch", torch.__version__, "SDPA default picks", SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True)))
PY
JOBS=("off|--fix off|6 7" "paper|--precision paper --fix off|0 1" "sdpa|--attn sdpa|0 1"
      "flash|--attn sdpa-flash|2 3" "fp32|--attn fp32|3 4" "on|--fix on|2 3" "sdpa|--attn sdpa|2 3"
      "paper|--precision paper --fix off|2 3")
run_jobs s13
