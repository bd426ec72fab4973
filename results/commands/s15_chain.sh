#!/bin/bash
# Session 15, as run (twice, 9 and 9 minutes, on nvidia-h200-x2: jobs 1 and 2 only; research.md, session 15): the
# sixth installment of issue 7's seed study at the default. After session 14: fix off 8 of 8 seeds collapsed
# (64,890-141,554 steps), lse64 2 of 2, fix on 2 of 2, the "paper" precision mode 2 of 2; fp32 reference attention 0
# of 3, o32 0 of 2, delta from P 0 of 1, the paper mode with delta from P 0 of 2 (77,000 steps; its layer 0 took off
# at 23,000-26,000 all the same); torch SDPA flash 0 of 2 by the loss (122,000 steps) and SDPA default (cuDNN) 0 of
# 2 (82,000 steps), both with layer 0 running away.
# Jobs in order of priority, one per GPU, two seeds side by side on each (~80,000 steps each in two calls; fp32
# ~65,000):
#   1. the paper mode, fix off, seeds 2 and 3 (its four seeds)   2. fp32 reference attention, seeds 3 and 4
#   3. torch SDPA flash, seeds 2 and 3        4. ours, fix on, seeds 2 and 3        5. SDPA default, seeds 2 and 3
# Call it twice back to back on one held machine (the largest kind `status` lists), carry ["data"]: `bash
# results/commands/s15_chain.sh 9`, again with 9 (the second call resumes what is unfinished); then `bash
# results/commands/s15_paper_dpn.sh 9` on the same machine.
. results/commands/chain_setup.sh "$@"
JOBS=("paper|--precision paper --fix off|2 3" "fp32|--attn fp32|3 4" "flash|--attn sdpa-flash|2 3"
      "on|--fix on|2 3" "sdpa|--attn sdpa|2 3")
run_jobs s15
