#!/bin/bash
# Session 4, CPU only (2 cores, two runs at a time, ~15 minutes a pair): the tiny model with the "vo" amplifier
# (V and O rounded to 1 mantissa bit, P in bf16), which amplifies the paper's tie bias
# (tests/test_mechanism.py::test_vo_amplifier_scales_the_tie_bias_and_the_fix_removes_it): at 1 bit fix off / fix on
# (stopped after step 1,000: both had grown), then 1 bit with delta from P and 3 bits with the fix off, 2,000 steps.
cd "$(dirname "$0")/../.."
run() { OMP_NUM_THREADS=1 python train.py --preset tiny --attn emulate --amplify vo --steps 4000 --device cpu \
          --log-interval 50 --diag-interval 250 --out runs/cpu_vo "$@" > /dev/null 2>&1 & }
run --mantissa-bits 1 --fix off --name vo1-off; run --mantissa-bits 1 --fix on --name vo1-on; wait
run --mantissa-bits 1 --fix off --delta-from-p --steps 2000 --name vo1-dp
run --mantissa-bits 3 --fix off --steps 2000 --name vo3-off; wait
python -m nanolp.sweep --collect runs/cpu_vo --csv results/search_cpu_vo.csv
