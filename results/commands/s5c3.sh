#!/bin/bash
# S5C3 (session 5): GPU 0: issue 6 with the new tuning table (backward unpipelined up to seq 512, 3 stages at
# head_dim 64, forward 4 stages at 128): the benchmark, then training throughput against SDPA (speed.py).
# GPU 1: the bits law's fourth point, P at 5 bits, fix off, alone.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
echo "commit $(git rev-parse --short HEAD 2>/dev/null)" > $OUT/commit.txt
R=runs/s5c3; mkdir -p $R
CUDA_VISIBLE_DEVICES=1 python train.py --minutes 7.6 --out $R --name p5-off-s0 --mantissa-bits 5 --fix off --seed 0 \
  --steps 200000 > $R/p5-off-s0.txt 2>&1 &
( CUDA_VISIBLE_DEVICES=0 timeout 240 python -m nanolp.bench --out $OUT/bench.csv > $OUT/bench.txt 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 220 python results/commands/speed.py --skip-grid --out $OUT > $OUT/speed.txt 2>&1 ) &
wait
python -m nanolp.sweep --collect $R --csv $OUT/s5c3.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
