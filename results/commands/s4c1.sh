#!/bin/bash
# S4C1 (session 4): issue 3 item 8 for the default (P at 3 bits), each run alone on a whole H200: fix off then fix on
# (GPU 0); delta = rowsum(dP * P) alone, the GPU test suite, then the benchmark (GPU 1).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
R=runs/s4c1; mkdir -p $R
solo() {  # solo GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1
}
( solo 0 off-s0 4.5 --fix off --seed 0; solo 0 on-s0 4 --fix on --seed 0 ) &
( solo 1 dp-s0 4.3 --fix off --delta-from-p --seed 0
  CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q tests/test_kernels.py tests/test_mechanism.py > $OUT/gpu_tests.txt 2>&1
  CUDA_VISIBLE_DEVICES=1 timeout 150 python -m nanolp.bench --out $OUT/bench.csv > $OUT/bench.txt 2>&1 ) &
wait
python -m nanolp.sweep --collect $R --csv $OUT/s4c1.csv
for f in $R/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
