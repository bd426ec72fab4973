#!/bin/bash
# Session 14, as run (twice, 9 and 9 minutes, on nvidia-h200-x2: jobs 1 and 2 only; research.md, session 14): the
# fifth installment of issue 7's seed study at the default. After session 13: fix off 8 of 8 seeds collapsed
# (64,890-141,554 steps), lse64 2 of 2, fix on 2 of 2; the "paper" precision mode 2 of 2 (35,630 / 86,880), its layer
# 0 taking off by step 12,000, which delta from P prevented and the fix did not (14,600 steps, seeds 0-1); fp32
# reference attention 0 of 3, o32 0 of 2, delta from P 0 of 1; torch SDPA flash 0 of 2 by the loss; SDPA's default
# backend at this shape is cuDNN (session 13), never run at the default.
# Jobs in order of priority, one per GPU, two seeds side by side on each: with one GPU only the first runs, with
# two the first two, and so on (device time is counted per machine, not per GPU).
#   1. the paper mode with delta from P, seeds 0 and 1, whole runs (does it keep the paper mode from collapsing?)
#   2. torch SDPA's default backend (cuDNN), seeds 0 and 1
#   3. the paper mode, fix off, seeds 2 and 3       4. fp32 reference attention, seeds 3 and 4
#   5. torch SDPA flash, seeds 2 and 3              6. ours, fix on, seeds 2 and 3
#   7. SDPA default, seeds 2 and 3
# Call it twice back to back on one held machine (the largest kind `status` lists), carry ["data"]: `bash
# results/commands/s14_chain.sh 9`, again with 9 (the second call resumes what is unfinished; two to a GPU reach
# ~95,000 steps, past both paper-mode collapses); then `bash results/commands/s14_paper_variants.sh 9`.
. results/commands/chain_setup.sh "$@"
JOBS=("paper-dp|--precision paper --fix off --delta-from-p|0 1" "sdpa|--attn sdpa|0 1"
      "paper|--precision paper --fix off|2 3" "fp32|--attn fp32|3 4" "flash|--attn sdpa-flash|2 3"
      "on|--fix on|2 3" "sdpa|--attn sdpa|2 3")
run_jobs s14
