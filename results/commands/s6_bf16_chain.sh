#!/bin/bash
# Plan for session 6 (not yet run): test the bits-law extrapolation (research.md, session 5, point 2: plain bf16
# at lr 1e-3 should collapse near 200,000-500,000 steps if the P-rounding term drives it) by training the default
# preset with P in plain bf16 as long as one session allows. Invoke this three times back to back on a warm
# nvidia-h200-x2 (runs/ survives between calls only while the machine is held: issue the next call at once);
# each call resumes both runs from their checkpoints. GPU 0: fix off; GPU 1: delta = rowsum(dP * P), the control.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
sha256sum kernels.py model.py train.py > $OUT/code.sha256
LONG="--mantissa-bits 0 --steps 1000000 --diag-interval 1000 --eval-interval 1000 --ckpt-interval 1000"
CUDA_VISIBLE_DEVICES=0 python -m nanolp.sweep --out runs/s6a --arm bf16lr1-off="--fix off $LONG" --seeds 0 \
  --minutes 9 --parallel 1 > $OUT/sweep_a.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 python -m nanolp.sweep --out runs/s6b --arm bf16lr1-dp="--fix off --delta-from-p $LONG" \
  --seeds 0 --minutes 9 --parallel 1 > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s6a runs/s6b --csv $OUT/s6.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
