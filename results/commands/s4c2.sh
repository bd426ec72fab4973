#!/bin/bash
# S4C2 (session 4): the two-part fix (fix=2, "--fix always": every tile's max shifted, l summed from the rounded P)
# at 3 bits (GPU 0, 4 side by side) and 2 bits (GPU 1, 4 side by side), next to fix off; then the benchmark.
# --fix always and the bench's ours_fix2 exist only at commit ad54d48 (removed after these runs): run it there.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
R=runs/s4c2; mkdir -p $R
go() {  # go GPU NAME MINUTES FLAGS...
  g=$1; n=$2; m=$3; shift 3
  CUDA_VISIBLE_DEVICES=$g python train.py --steps 200000 --minutes $m --out $R --name $n "$@" > $R/$n.txt 2>&1 &
}
for s in 0 1 2; do go 0 b3-always-s$s 8.1 --fix always --seed $s; done
go 0 b3-off-s1 8.1 --fix off --seed 1
for a in always off on; do go 1 b2-$a-s0 6.3 --mantissa-bits 2 --fix $a --seed 0; done
go 1 b2-dp-s0 6.3 --mantissa-bits 2 --fix off --delta-from-p --seed 0
sleep 400
CUDA_VISIBLE_DEVICES=1 timeout 150 python -m nanolp.bench --seqs 1024 4096 16384 --out $OUT/bench.csv > $OUT/bench.txt 2>&1
wait
python -m nanolp.sweep --collect $R --csv $OUT/s4c2.csv
for f in $R/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 4; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
