#!/bin/bash
# Session 13, with the device time left after s13_chain.sh (~6 minutes): is the "paper" precision mode's early
# take-off (layer 0's max logit past 100 at step 12,000 in both seeds, against 35,000-80,000 in fa2) the paper's
# mechanism? Same seeds as paper-s0/s1 (same init and batches), 2 to a GPU, ~18,000 steps each:
#   GPU 0: "paper" mode with the fix on, seeds 0 and 1
#   GPU 1: "paper" mode with delta = rowsum(dP * P) (the paper's localisation control), seeds 0 and 1
# Run as `bash results/commands/s13_paper.sh 4` on nvidia-h200-x2, carry ["data"].
. results/commands/chain_setup.sh "$@"
JOBS=("paper-on|--precision paper --fix on|0 1" "paper-dp|--precision paper --fix off --delta-from-p|0 1")
run_jobs s13p
