#!/bin/bash
# Session 14, as run (once, 9 minutes, on nvidia-h200-x2, right after the two calls of s14_chain.sh on the same held
# machine; research.md, session 14): which of the "paper" mode's roundings makes its layer 0 take off by step 12,000
# (research.md, session 13, point 2)? In the paper mode, fix off, layer 0's max logit passed 100 at step 12,000 on
# seeds 0 and 1 (292 / 2,047 at 14,000), while delta from P kept it at 14-21 through 14,600 steps: the growth runs
# through delta. Four arms, each taking one group of the paper mode's roundings out of what delta reads, fix off, the
# four side by side on each GPU (GPU i: seed i), ~20,000 steps each (four to a GPU, ~0.75M tokens/s each):
#   paper-o32         --delta-fp32: delta reads O before its final cast (the cure of the fa2 mode, session 9)
#   paper-s32         scores kept in fp32, forward and backward (variants.py)
#   paper-acc32       P V and the accumulator in fp32 (variants.py)
#   paper-acc32-o32   both
# On random rows (results/variants_cpu_s13.txt) the paper mode puts ~1.6x fa2's error into delta, --delta-fp32
# ~1.3x, paper-s32 ~1.9x, paper-acc32 about fa2's, paper-acc32-o32 0.25-0.9x fa2's (less at larger logits). If the
# error's size sets the take-off, paper-acc32 takes off like fa2 (35,000-80,000) and paper-acc32-o32 not at all.
# An arm whose layer 0 stays near 20 past step 15,000 removed the rounding that matters. Checked on the CPU:
# `python results/commands/variants_cpu.py` (results/variants_cpu_s13.txt: each variant changes the paper mode's O,
# keeps O and the gradients within twice plain bf16's error of float64, and the error each arm leaves in delta).
# Run as `bash results/commands/s14_paper_variants.sh 9` on nvidia-h200-x2 (with one GPU, seed 0 only), carry
# ["data"].
. results/commands/chain_setup.sh "$@"
for v in paper-s32 paper-acc32; do [ -d /tmp/$v ] || python results/commands/variants.py $v /tmp/$v; done
ARMS=("paper-o32|$R|--delta-fp32" "paper-s32|/tmp/paper-s32|" "paper-acc32|/tmp/paper-acc32|"
      "paper-acc32-o32|/tmp/paper-acc32|--delta-fp32")
for ((gpu = 0; gpu < $(nvidia-smi -L | wc -l) && gpu < 2; gpu++)); do
  for arm in "${ARMS[@]}"; do
    IFS='|' read -r name dir flags <<< "$arm"
    (cd $dir && CUDA_VISIBLE_DEVICES=$gpu python -m nanolp.sweep --out $R/runs/pv-$name-$gpu \
      --arm $name="--precision paper --fix off $flags" --seeds $gpu --minutes $(left)) > runs/pv-$name-$gpu.txt 2>&1 &
  done
done
wait
python -m nanolp.sweep --collect runs/pv-*/ --csv $OUT/pv.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs/pv-* runs/code.sha256
