#!/bin/bash
# Session 6: test the bits-law extrapolation (research.md, session 5, point 2: plain bf16 at lr 1e-3 should take
# off near 226,000 steps and collapse near 466,000 if the P-rounding term drives it) by training the default
# preset with P in plain bf16 as long as one session allows. Call it three times back to back on one held
# nvidia-h200-x2 (runs/ survives between calls only while the machine is held; a machine goes back after 30
# minutes whatever happens, and the session has 30 device-minutes): `bash results/commands/s6_bf16_chain.sh 9`,
# again with 9, then with less so the last call ends inside the budget. Each call resumes both runs from their
# checkpoints. GPU 0: fix off; GPU 1: delta = rowsum(dP * P), the control. train.py now compiles with CUDA graphs
# (reduce-overhead) on cuda, new this session: if a run dies early under them, it goes on with --compile default.
# The first call also runs the GPU test suite on GPU 1 beside the control.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
sha256sum kernels.py model.py train.py nanolp/*.py > $OUT/code.sha256
if [ ! -d runs/s6a ]; then
  CUDA_VISIBLE_DEVICES=1 timeout 420 python -m pytest -q tests/test_kernels.py tests/test_mechanism.py \
    tests/test_train.py > $OUT/gpu_tests.txt 2>&1 &
fi
LONG="--mantissa-bits 0 --steps 1000000 --diag-interval 1000 --eval-interval 1000 --ckpt-interval 5000"

arm() {  # arm GPU OUTDIR NAME FLAGS: one run, this call's MIN minutes; CUDA graphs, else torch.compile's default
  local start=$SECONDS
  CUDA_VISIBLE_DEVICES=$1 python -m nanolp.sweep --out $2 --arm "$3=$4" --seeds 0 --minutes $MIN --parallel 1
  local left=$(python -c "print(round($MIN - ($SECONDS - $start) / 60, 2))")
  if python -c "exit(not $left > 2)"; then  # (a finished run, e.g. a collapse, is skipped by the sweep)
    echo "$3 stopped early under CUDA graphs; $left minutes left: --compile default"
    CUDA_VISIBLE_DEVICES=$1 python -m nanolp.sweep --out $2 --arm "$3=$4 --compile default" --seeds 0 \
      --minutes $left --parallel 1
  fi
}
arm 0 runs/s6a bf16lr1-off "--fix off $LONG" > $OUT/sweep_a.txt 2>&1 &
arm 1 runs/s6b bf16lr1-dp "--fix off --delta-from-p $LONG" > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s6a runs/s6b --csv $OUT/s6.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
