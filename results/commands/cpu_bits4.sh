#!/bin/bash
# Session 5, CPU only (one core, ~95 minutes): the tiny model with P at 4 bits, fix off, 24,000 steps: the third
# point of cpu_bits.sh's law (take-off at 1,500 steps with 2 bits, 5,250 with 3).
cd "$(dirname "$0")/../.."
OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --steps 24000 --device cpu --log-interval 50 \
  --diag-interval 250 --out runs/cpu_bits --name b4off --mantissa-bits 4 --fix off > /dev/null 2>&1
python -m nanolp.sweep --collect runs/cpu_bits --csv results/search_cpu_bits.csv
