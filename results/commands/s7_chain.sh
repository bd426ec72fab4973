#!/bin/bash
# Session 7 (run as planned; results in results/research.md, session 7):
# criterion 2 of issue 5 for the new default (plain bf16, lr 1e-3), issue 6's
# training throughput under CUDA graphs, and the first seeds of issue 7. Session 6's default run, seed 0, went
# non-finite at step 94,798 with the fix off and trained 242,864 steps with delta from P; the fix has not been
# run. Call it three times back to back on one held nvidia-h200-x2 (runs/ survives between calls only while the
# machine is held): `bash results/commands/s7_chain.sh 9`, again with 9, then with 9.4 (session 6's timings:
# each call's wall time is about MIN minutes; three calls and the machine's start fit the 30 device-minutes).
# Each call resumes what is unfinished.
# GPU 0: fix on, seed 0, alone, to the default's 200,000 steps (twice the fix-off collapse; ~20 minutes).
# GPU 1, first call only: the GPU suite (the kernels store O, dQ, dK, dV in q's layout since the end of session
#   6, tested on the CPU only), then speed.py under CUDA graphs (ours vs SDPA flash / cuDNN, alone on the GPU);
#   then, in every call, what is unfinished of: fix off, seed 1 (~10 minutes if it collapses as seed 0 did: is
#   the collapse reproducible?), then fix off at lr 3e-3, seed 0 (does it collapse in fewer steps? issue 7 needs
#   ~490 GPU-minutes at lr 1e-3).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
START=$SECONDS
mkdir -p runs; sha256sum kernels.py model.py train.py nanolp/*.py > runs/code.sha256  # in logs.tgz: at most 8 files return
CUDA_VISIBLE_DEVICES=0 python -m nanolp.sweep --out runs/s7a --arm on="--fix on" --seeds 0 --minutes $MIN \
  --parallel 1 > $OUT/sweep_a.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  if [ ! -d runs/s7b ]; then
    timeout 300 python -m pytest -q tests/test_kernels.py tests/test_train.py > $OUT/gpu_tests.txt 2>&1 || exit 1
    timeout 300 python results/commands/speed.py --skip-grid --modes reduce-overhead --out $OUT > $OUT/speed.txt 2>&1
  fi
  left() { python -c "print(round($MIN - ($SECONDS - $START) / 60, 2))"; }
  python -m nanolp.sweep --out runs/s7b --arm off="--fix off" --seeds 1 --minutes $(left) --parallel 1
  python -m nanolp.sweep --out runs/s7b --arm off-lr3="--fix off --lr 3e-3" --seeds 0 --minutes $(left) --parallel 1
) > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s7a runs/s7b --csv $OUT/s7.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
