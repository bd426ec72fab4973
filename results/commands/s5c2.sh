#!/bin/bash
# S5C2 (session 5): GPU 0: issue 6's tuning grid and training throughput (results/commands/speed.py, alone on
# the GPU), then --amplify vo at 2 bits (fix off / on / delta from P side by side) in the time left.
# GPU 1: the bits law's third point again, P at 4 bits, fix off, alone (S5C1's run had torch.compile breaking
# the graph at every attention call: half speed).
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
echo "commit $(git rev-parse --short HEAD 2>/dev/null)" > $OUT/commit.txt
R=runs/s5c2; mkdir -p $R
run() {  # run GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1
}
run 1 p4-off-s0 8.4 --mantissa-bits 4 --fix off --seed 0 --steps 100000 &
( CUDA_VISIBLE_DEVICES=0 timeout 400 python results/commands/speed.py --out $OUT > $OUT/speed.txt 2>&1
  left=$(python -c "print(round(max(0.5, (520 - $SECONDS) / 60 - 0.4), 2))")
  for arm in "off --fix off" "on --fix on" "dp --fix off --delta-from-p"; do
    set -- $arm; n=$1; shift
    run 0 vo2-$n-s0 $left --mantissa-bits 2 --amplify vo --seed 0 --steps 100000 "$@" &
  done
  wait ) &
wait
python -m nanolp.sweep --collect $R --csv $OUT/s5c2.csv
for f in $R/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
