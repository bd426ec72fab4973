#!/bin/bash
# Plan for session 6 (not yet run): test the bits-law extrapolation (research.md, session 5, point 2: plain bf16
# at lr 1e-3 should take off near 226,000 steps and collapse near 466,000 if the P-rounding term drives it) by
# training the default preset with P in plain bf16 as long as one session allows. Call it three times back to back
# on one held nvidia-h200-x2 (runs/ survives between calls only while the machine is held; a machine goes back
# after 30 minutes whatever happens, and the session has 30 device-minutes): `bash results/commands/
# s6_bf16_chain.sh 9`, again with 9, then with 7.5 so the last call ends inside the budget. Each call resumes both
# runs from their checkpoints. GPU 0: fix off; GPU 1: delta = rowsum(dP * P), the control. The first call also
# runs the GPU test suite on GPU 1 beside the control (the tuning table of session 5 has not been through it).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
sha256sum kernels.py model.py train.py > $OUT/code.sha256
if [ ! -d runs/s6a ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 300 python -m pytest -q tests/test_kernels.py tests/test_mechanism.py \
    > $OUT/gpu_tests.txt 2>&1 &
fi
LONG="--mantissa-bits 0 --steps 1000000 --diag-interval 1000 --eval-interval 1000 --ckpt-interval 1000"
CUDA_VISIBLE_DEVICES=0 python -m nanolp.sweep --out runs/s6a --arm bf16lr1-off="--fix off $LONG" --seeds 0 \
  --minutes $MIN --parallel 1 > $OUT/sweep_a.txt 2>&1 &
CUDA_VISIBLE_DEVICES=1 python -m nanolp.sweep --out runs/s6b --arm bf16lr1-dp="--fix off --delta-from-p $LONG" \
  --seeds 0 --minutes $MIN --parallel 1 > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s6a runs/s6b --csv $OUT/s6.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
