#!/bin/bash
# C2 (session 3): issue 3 item 8 - --preset bf16 (the default then), fix off and fix on, each alone on a whole H200.
export OUT=${OUT:-out}; mkdir -p $OUT   # where the collected CSVs and logs go
export PYTHONUNBUFFERED=1
mkdir -p runs/solo
for i in 0 1; do
  fix=$([ $i = 0 ] && echo off || echo on)
  CUDA_VISIBLE_DEVICES=$i python train.py --preset bf16 --fix $fix --steps 1000000 --minutes 8.8 --out runs/solo --name default-$fix-s0 \
    > runs/solo/default-$fix.txt 2>&1 &
done
sleep 90; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv; wait
python -m nanolp.sweep --collect runs/solo --csv $OUT/solo.csv
for f in runs/solo/*.txt; do tr '\r' '\n' < $f | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
