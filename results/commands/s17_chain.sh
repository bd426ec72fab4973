#!/bin/bash
# Plan for the next session (not yet run; issue 7 closed in session 16, so this is follow-up work): after session
# 16 every control of issue 7 has four seeds or more (torch SDPA flash and SDPA default 0 of 4 by the loss, layer 0
# running away in all eight), and what is left open is the paper mode's control over a whole run and the rate of
# the fix on at more seeds (2 of 2 collapsed; research.md, session 16, "Next").
# Jobs in order of priority, one per GPU, two seeds side by side on each (~80,000-125,000 steps in three calls):
#   1. the paper mode with delta from P (divided since session 15), seeds 0 and 1, a whole run (fix off collapsed
#      at 35,630 / 86,880 on these seeds; the divided control has been run to 38,600 only)
#   2. ours, fix on, seeds 2 and 3        3. fix on, seeds 4 and 5        4. fix on, seeds 6 and 7
# Call it three times back to back on one held machine (the largest kind `status` lists), carry ["data"]: `bash
# results/commands/s17_chain.sh 9`, again with 9, then 9 (each call resumes what is unfinished).
. results/commands/chain_setup.sh "$@"
JOBS=("paper-dpn|--precision paper --fix off --delta-from-p|0 1" "on|--fix on|2 3" "on|--fix on|4 5"
      "on|--fix on|6 7")
run_jobs s17
