#!/bin/bash
# C1 (session 3, --preset bf16 was the default then): GPU0 key-tile-width experiment; GPU1 #7 reference controls (4 seeds each).
export OUT=${OUT:-out}; mkdir -p $OUT   # where the collected CSVs and logs go
export PYTHONUNBUFFERED=1
nvidia-smi -L
tile() {  # tile WIDTH NAME FLAGS...: train.py with kernels.TILE_N patched (forward key tiles)
  w=$1; n=$2; shift 2
  CUDA_VISIBLE_DEVICES=0 python -c "import sys, runpy, kernels; kernels.TILE_N = $w; sys.argv = ['train.py'] + sys.argv[1:]; runpy.run_path('train.py', run_name='__main__')" \
    --preset bf16 --out runs/tile --name $n --minutes 7.9 "$@" > runs/tile-$n.txt 2>&1 &
}
mkdir -p runs
for s in 0 1 2 3; do tile 128 t128off-s$s --fix off --seed $s; done
for s in 2 3; do tile 64 t64off-s$s --fix off --seed $s; done
for s in 2 3; do CUDA_VISIBLE_DEVICES=0 python train.py --preset bf16 --attn sdpa-flash --seed $s --out runs/tile --name flash-s$s --minutes 7.9 > runs/tile-flash-s$s.txt 2>&1 & done
CUDA_VISIBLE_DEVICES=1 python -m nanolp.sweep --arm fp32="--preset bf16 --attn fp32" --arm sdpaflash="--preset bf16 --attn sdpa-flash" --arm sdpa="--preset bf16 --attn sdpa" \
  --seeds 0 1 2 3 --minutes 8.6 --grace 20 --out runs/ctrl > runs/ctrl.txt 2>&1 &
sleep 60; nvidia-smi; wait
python -m nanolp.sweep --collect runs/tile --csv $OUT/tile.csv
cp runs/ctrl/summary.csv $OUT/ctrl.csv
tail -n 3 runs/*.txt > $OUT/tails.txt
tar czf $OUT/logs.tgz --exclude=ckpt runs
