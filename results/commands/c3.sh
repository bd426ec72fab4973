#!/bin/bash
# C3 (session 3): the default preset (P at 3 bits; run as --preset p3, since renamed default) with the cross-tile fix and the delta = rowsum(dP * P) control.
export OUT=${OUT:-out}; mkdir -p $OUT   # where the collected CSVs and logs go
export PYTHONUNBUFFERED=1
mkdir -p runs/p3
go() {  # go GPU NAME FLAGS...
  g=$1; n=$2; shift 2
  CUDA_VISIBLE_DEVICES=$g python train.py --steps 200000 --minutes 8.2 --out runs/p3 --name $n "$@" \
    > runs/p3/$n.txt 2>&1 &
}
for s in 0 1; do go 0 p3on-s$s --fix on --seed $s; go 0 p3dp-s$s --fix off --delta-from-p --seed $s; done
for s in 0 1; do go 1 p3off-s$s --fix off --seed $s; done
go 1 p3on-s2 --fix on --seed 2; go 1 p3dp-s2 --fix off --delta-from-p --seed 2
CUDA_VISIBLE_DEVICES=1 timeout 300 python -m pytest -q -x tests/test_kernels.py tests/test_mechanism.py > $OUT/gpu_tests.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/p3 --csv $OUT/p3.csv
for f in runs/p3/*.txt; do echo $f; tr '\r' '\n' < $f | grep -v "^ *[0-9]*%" | tail -n 3; done > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
