#!/bin/bash
# Session 12 (run as below; results in results/research.md, session 12): the third installment of issue 7's seed
# study at the default. After session 11: fix off 4 of 4 seeds collapsed (64,890-110,503 steps) and lse64 2 of 2
# (so the fp32 lse is not what ends them), fix on 2 of 2; o32 0 of 2, delta from P 0 of 1, fp32 reference attention
# 0 of 1 (61,191 steps, layer 0 flat at 9.5); torch SDPA flash 0 of 2 by the loss, its layer-0 logits running away
# like ours.
# Jobs in order of priority, one per GPU, two seeds side by side on each (two to a GPU reach ~125,000 steps each
# in three calls): with one GPU only the first runs, with two the first two, and so on (device time is counted
# per machine, not per GPU, so take the largest kind `status` lists).
#   1. ours, fix off, seeds 4 and 5 (towards the 8 seeds; 3 of 4 collapsed by 95,000 steps)
#   2. fp32 reference attention, seeds 1 and 2 (the main control; ~1.1M tokens/s each two to a GPU, ~90,000 steps)
#   3. ours, fix on, seeds 2 and 3          4. torch SDPA's default backend, seeds 0 and 1
#   5. ours in the "paper" precision mode, fix off, seeds 0 and 1          6. ours, fix off, seeds 6 and 7
#   7. torch SDPA flash, seeds 2 and 3      8. ours, --delta-fp32, seeds 2 and 3
# Call it three times back to back on one held machine (nvidia-h200-x2 if lent, else nvidia-h200), carry
# ["data"]: `bash results/commands/s12_chain.sh 9`, again with 9, then 9.4. Each call resumes what is unfinished.
# (Run on nvidia-h200-x2 with 9, 9, then 9.3: jobs 1 and 2, two seeds on each GPU; seeds.csv calls it s12c1-3.)
. results/commands/chain_setup.sh "$@"
JOBS=("off|--fix off|4 5" "fp32|--attn fp32|1 2" "on|--fix on|2 3" "sdpa|--attn sdpa|0 1"
      "paper|--precision paper --fix off|0 1" "off|--fix off|6 7" "flash|--attn sdpa-flash|2 3"
      "o32|--fix off --delta-fp32|2 3")
run_jobs s12
