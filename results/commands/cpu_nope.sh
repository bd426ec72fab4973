#!/bin/bash
# Session 4, CPU only (2 cores, two runs at a time, ~15 minutes a pair): the tiny model in plain bf16 (no
# amplifier) without position embeddings (--pos none), so layer 0's repeated tokens tie exactly (tie rate
# 11-29% of rows in training, against <0.4% with learned positions in the 6-layer bf16 runs): fix off / fix on.
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --steps 4000 --device cpu \
          --log-interval 50 --diag-interval 250 --out runs/cpu_nope "$@" > /dev/null 2>&1 & }
run --pos none --fix off --name nope-off; run --pos none --fix on --name nope-on; wait
python -m nanolp.sweep --collect runs/cpu_nope --csv results/search_cpu_nope.csv
