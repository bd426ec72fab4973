#!/bin/bash
# Session 4, CPU only (2 cores, ~15 minutes): does the tiny model show the "paper" precision mode's fast layer-0
# logit growth in bf16 (GPU 6-layer: 57 -> 1,138 between steps 2,000 and 4,000, research.md session 4 point 3)?
# paper mode and fa2 mode, fix off, no amplifier, 4,000 steps.
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --steps 4000 --device cpu \
          --log-interval 50 --diag-interval 250 --out runs/cpu_paper "$@" > /dev/null 2>&1 & }
run --precision paper --fix off --name paper-off; run --precision fa2 --fix off --name fa2-off; wait
python -m nanolp.sweep --collect runs/cpu_paper --csv results/search_cpu_paper.csv
