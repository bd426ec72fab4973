#!/bin/bash
# Plan for session 7 (not yet run): criterion 2 of issue 5 for the new default (plain bf16, lr 1e-3), and the
# first seeds of issue 7. Session 6's default run, seed 0, went non-finite at step 94,798 with the fix off and
# trained 242,864 steps with delta from P; the fix has not been run. Call it three times back to back on one held
# nvidia-h200-x2 (runs/ survives between calls only while the machine is held): `bash results/commands/
# s7_chain.sh 9`, again with 9, then with 9.4 (session 6's timings: each call's wall time is about MIN minutes;
# the three calls and the machine's start fit the 30 device-minutes). Each call resumes what is unfinished.
# GPU 0: fix on, seed 0, alone, to the default's 200,000 steps (twice the fix-off collapse; ~20 minutes).
# GPU 1: fix off, seeds 1, 2, 3 one after another (each ~10 minutes if it collapses as seed 0 did).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
sha256sum kernels.py model.py train.py nanolp/*.py > $OUT/code.sha256
CUDA_VISIBLE_DEVICES=0 python -m nanolp.sweep --out runs/s7a --arm on="--fix on" --seeds 0 --minutes $MIN \
  --parallel 1 > $OUT/sweep_a.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 python -m nanolp.sweep --out runs/s7b --arm off="--fix off" --seeds 1 2 3 --minutes $MIN \
  --parallel 1 > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s7a runs/s7b --csv $OUT/s7.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
