#!/bin/bash
# Plan for session 11 (not yet run): the second installment of issue 7's seed study at the default. After session
# 10: fix off 4 of 4 seeds collapsed (64,890-110,503 steps), fix on 2 of 2, o32 0 of 2, delta from P 0 of 1; torch
# SDPA flash 0 of 2 by the loss, but its layer-0 logits ran away like ours (1.4e6 and 3.2e7 at 122,000 steps).
#   GPU 0: fp32 reference attention (`--attn fp32`), seeds 0 and 1: the issue's main control, never run at the
#          default (session 3 ran it at lr 3e-3 for 4,000-12,000 steps). Its speed under CUDA graphs is unmeasured;
#          session 3 (no graphs) had it at 0.73x SDPA's tokens/s, which would give ~105,000 steps each here.
#   GPU 1: does the loss blow-up need the fp32 lse? Every collapse came after the max logit passed 1e8, where the
#          kernel's fp32 lse loses a tie's log2(l) (research.md, session 10, point 5); torch flash stopped at 3.2e7
#          without one. lse64 (results/commands/variants.py: lse in fp64, the backward's S - lse in fp64; checked on
#          the CPU, results/variants_cpu_s10.txt), fix off, seeds 2 and 3 (plain: collapsed at 70,391 and 64,890).
#          A 300-step smoke run of it comes first; if it fails (fp64 in a compiled kernel is new here), GPU 1 runs
#          the fix on, seeds 2 and 3, instead, and lse64_smoke.txt says why.
# Call it three times back to back on one held nvidia-h200-x2, carry ["data"]: `bash results/commands/s11_chain.sh 9`,
# again with 9, then 9.4. Each call resumes what is unfinished.
. results/commands/chain_setup.sh "$@"
[ -d /tmp/lse64 ] || python results/commands/variants.py lse64 /tmp/lse64
(
  export CUDA_VISIBLE_DEVICES=0
  python -m nanolp.sweep --out runs/s11a --arm fp32="--attn fp32" --seeds 0 1 --minutes $(left)
) > $OUT/sweep_a.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  if [ ! -f runs/s11b.arm ]; then   # the first call decides GPU 1's arm for the session
    (cd /tmp/lse64 && timeout 300 python train.py --fix off --steps 300 --out /tmp/smoke --name lse64) \
      > $OUT/lse64_smoke.txt 2>&1
    if grep -q '"collapsed": false' /tmp/smoke/lse64/summary.json; then echo lse64; else echo on; fi > runs/s11b.arm
  fi
  if [ "$(cat runs/s11b.arm)" = lse64 ]; then
    (cd /tmp/lse64 && python -m nanolp.sweep --out $R/runs/s11b --arm lse64="--fix off" --seeds 2 3 --minutes $(left))
  else
    python -m nanolp.sweep --out runs/s11b --arm on="--fix on" --seeds 2 3 --minutes $(left)
  fi
) > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s11a runs/s11b --csv $OUT/s11.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
