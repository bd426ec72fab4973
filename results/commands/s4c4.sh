#!/bin/bash
# S4C4 (session 4): bf16 in the "paper" precision mode, alone on each GPU: fix on (GPU 0), delta from P (GPU 1),
# to set beside S4C3's fix off (layer-0 logits 57 -> 1,138 between steps 2,000 and 4,000).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
R=runs/s4c4; mkdir -p $R
solo() {  # solo GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --steps 200000 --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1
}
solo 0 bf16-paper-on-s0 3.6 --preset bf16 --precision paper --fix on --seed 0 &
solo 1 bf16-paper-dp-s0 3.6 --preset bf16 --precision paper --fix off --delta-from-p --seed 0 &
wait
python -m nanolp.sweep --collect $R --csv $OUT/s4c4.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
