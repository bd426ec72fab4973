#!/bin/bash
# S5C1 (session 5): where do ties between different tokens get common? The paper's GPT-2 shape (--preset gpt2:
# 12 layers, 12 heads, context 1024) in plain bf16, fix off, alone on GPU 0, per-head tie rates in its log.
# GPU 1: the GPU test suite (validates --amplify vo on triton 3.6) beside the third point of the bits law: P at
# 4 bits, fix off, alone.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
echo "commit $(git rev-parse --short HEAD 2>/dev/null)" > $OUT/commit.txt
R=runs/s5c1; mkdir -p $R
solo() {  # solo GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1
}
solo 0 gpt2-off-s0 8.2 --preset gpt2 --fix off --seed 0 --steps 100000 &
solo 1 p4-off-s0 8.2 --mantissa-bits 4 --fix off --seed 0 --steps 100000 &
CUDA_VISIBLE_DEVICES=1 timeout 200 python -m pytest -q tests/test_kernels.py tests/test_mechanism.py > $OUT/gpu_tests.txt 2>&1
wait
python -m nanolp.sweep --collect $R --csv $OUT/s5c1.csv
for f in $R/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
