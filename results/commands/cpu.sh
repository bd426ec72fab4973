#!/bin/bash
# Session 3, CPU only (2 cores, two runs at a time, ~15 minutes a pair): P at 1 mantissa bit in the tiny model,
# attention through the emulation (the kernel's numerics in PyTorch). Variants of the forward: cpu_variant.py.
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python "$@" --preset tiny --attn emulate --mantissa-bits 1 --steps 4000 --device cpu \
          --log-interval 50 --diag-interval 250 --out runs/cpu & }
run train.py --fix off --name b1off; run train.py --fix off --delta-from-p --name b1dp; wait
NORM=1 run results/commands/cpu_variant.py --fix off --name b1norm; run train.py --fix on --name b1on; wait
ALWAYS=1 NORM=1 run results/commands/cpu_variant.py --fix on --name b1alwaysnorm
ALWAYS=1 run results/commands/cpu_variant.py --fix on --name b1always; wait
run train.py --fix off --seed 1 --name b1off-s1; run train.py --fix off --delta-from-p --seed 1 --name b1dp-s1; wait
run train.py --fix on --seed 1 --name b1on-s1
ALWAYS=1 NORM=1 run results/commands/cpu_variant.py --fix on --seed 1 --name b1alwaysnorm-s1; wait
python -m nanolp.sweep --collect runs/cpu --csv results/search_cpu.csv
