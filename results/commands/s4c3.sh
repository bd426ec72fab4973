#!/bin/bash
# S4C3 (session 4): bf16 at batch 512 (131k tokens/step; the noise-versus-bias lead), fix off, alone on GPU 0;
# on GPU 1 the fix-cost experiment (issue 6), then bf16 in the "paper" precision mode, fix off, alone.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
R=runs/s4c3; mkdir -p $R
solo() {  # solo GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --steps 200000 --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1
}
solo 0 bf16-b512-off-s0 7.9 --preset bf16 --batch-size 512 --fix off --seed 0 &
( CUDA_VISIBLE_DEVICES=1 timeout 170 python results/commands/fix_cost.py --out $OUT/fix_cost.csv > $OUT/fix_cost.txt 2>&1
  solo 1 bf16-paper-off-s0 5.3 --preset bf16 --precision paper --fix off --seed 0 ) &
wait
python -m nanolp.sweep --collect $R --csv $OUT/s4c3.csv
for f in $R/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
