#!/bin/bash
# Session 15, as run (once, 9 minutes, on nvidia-h200-x2, at commit 6a4296d; research.md, session 15, points 3-4:
# paper-dpn held layer 0 flat, so since then it is what `--precision paper --delta-from-p` does and variants.py has
# no paper-dpn; to rerun this exactly, check out 6a4296d). After two calls of s15_chain.sh on the same machine: is
# the paper mode's take-off with delta from P (session 14, point 2: past 100 at 23,000 / 26,000 steps, where the fa2
# mode with delta from P stays flat) the bf16 l of the paper mode? There the backward's P sums to 1 + O(2^-9) per
# row, so with delta from P the rows of dS do not sum to zero: an error along P 1.1-1.6x the size of fa2's failing
# delta error on random rows (`python results/commands/rowsum_cpu.py`, results/rowsum_cpu_s14.txt). variants.py
# paper-dpn divides delta from P by rowsum(P), which zeroes those row sums (checked there bit for bit against the
# emulation).
#   GPU 0: paper-dpn (--precision paper --delta-from-p), seeds 0 and 1, two to the GPU (~45,000 steps)
#   GPU 1: paper-s32 with --delta-from-p, seeds 0 and 1 (paper-s32 fix off collapsed at 13,009 / 14,287)
# If paper-dpn's layer 0 stays near 20 past step 30,000 while paper with delta from P had taken off, the row sums
# were the paper mode's second path, and paper-dpn is the clean control of the paper mode.
# Run as `bash results/commands/s15_paper_dpn.sh 9` on nvidia-h200-x2 (with one GPU, GPU 0's arm only), carry
# ["data"].
. results/commands/chain_setup.sh "$@"
for v in paper-dpn paper-s32; do [ -d /tmp/$v ] || python results/commands/variants.py $v /tmp/$v; done
ARMS=("paper-dpn|/tmp/paper-dpn" "paper-s32-dp|/tmp/paper-s32")
for ((gpu = 0; gpu < $(nvidia-smi -L | wc -l) && gpu < 2; gpu++)); do
  IFS='|' read -r name dir <<< "${ARMS[$gpu]}"
  (cd $dir && CUDA_VISIBLE_DEVICES=$gpu python -m nanolp.sweep --out $R/runs/pd-$name \
    --arm $name="--precision paper --fix off --delta-from-p" --seeds 0 1 --minutes $(left)) > runs/pd-$name.txt 2>&1 &
done
wait
python -m nanolp.sweep --collect runs/pd-*/ --csv $OUT/pd.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs/pd-* runs/code.sha256
