#!/bin/bash
# Session 4, CPU only (2 cores, one run per core, ~30 minutes): the tiny model with P at 2 and 3 mantissa bits,
# fix off, 8,000 steps, next to session 3's 1-bit runs (cpu.sh): how the logit growth's onset moves with the bits.
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --steps 8000 --device cpu \
          --log-interval 50 --diag-interval 250 --out runs/cpu_bits "$@" > /dev/null 2>&1 & }
run --mantissa-bits 2 --fix off --name b2off; run --mantissa-bits 3 --fix off --name b3off; wait
python -m nanolp.sweep --collect runs/cpu_bits --csv results/search_cpu_bits.csv
