#!/bin/bash
# Session 5, CPU only (one run per core, ~95 minutes): the tiny model with P at 4 bits, 24,000 steps, fix off: the
# third point of cpu_bits.sh's law (take-off at 1,500 steps with 2 bits, 5,250 with 3); and delta from P beside it.
# (As run: the fix-off run started a few minutes before the control, with the same command line.)
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --steps 24000 --device cpu --log-interval 50 \
          --diag-interval 250 --out runs/cpu_bits --mantissa-bits 4 --fix off "$@" > /dev/null 2>&1 & }
run --name b4off; run --name b4dp --delta-from-p; wait
python -m nanolp.sweep --collect runs/cpu_bits --csv results/search_cpu_bits.csv
