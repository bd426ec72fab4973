#!/bin/bash
# Session 8 (run as planned; results in results/research.md, session 8).
# Session 7 found that in plain bf16 the fix does not cure the default run
# (lr 1e-3, seed 0: fix on collapsed at step 69,890, fix off at 94,798 and, seed 1, 110,503), while delta from P
# does; at lr 3e-3 fix off collapsed at 30,909 (3.2 minutes) and the fix on had not collapsed at 59,237, its
# layer-0 logits growing (6,600), delta from P flat (233). This plan asks three questions:
#   GPU 0: does the fix on at lr 3e-3 collapse (seed 0, to 120,000 steps, ~4x fix off's collapse)? Then fix on,
#          lr 1e-3, seed 1 (a second seed of criterion 2 at the default) for the rest of the time.
#   GPU 1: is the lr 3e-3 collapse reproducible (fix off, seeds 1, 2, 3, up to 90,000 steps each)? And which
#          rounding fails plain bf16 (results/commands/variants.py, fix off, lr 3e-3, seed 0, up to 70,000
#          steps): p16 (P 8x finer, O's cast unchanged) and o32 (delta reads O before its cast, P unchanged).
#          First, in the first call only, the kernel benchmark (issue 6) with delta from P as a column: what the
#          one change that prevented every collapse costs.
# Call it three times back to back on one held nvidia-h200-x2, carry ["data"]: `bash results/commands/s8_chain.sh 9`,
# again with 9, then 9.4 (each call's wall time is about MIN minutes). Each call resumes what is unfinished.
. results/commands/chain_setup.sh "$@"
[ -d /tmp/p16 ] || python results/commands/variants.py p16 /tmp/p16
(
  export CUDA_VISIBLE_DEVICES=0
  python -m nanolp.sweep --out runs/s8a --arm on-lr3="--fix on --lr 3e-3" --seeds 0 --steps 120000 \
    --minutes $(left) --parallel 1
  python -m nanolp.sweep --out runs/s8a --arm on="--fix on" --seeds 1 --minutes $(left) --parallel 1
) > $OUT/sweep_a.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  [ -d runs/s8b ] || timeout 240 python -m nanolp.bench --seqs 1024 4096 16384 --out $OUT/bench_s8.csv > $OUT/bench.txt 2>&1
  python -m nanolp.sweep --out runs/s8b --arm off-lr3="--fix off --lr 3e-3" --seeds 1 --steps 90000 \
    --minutes $(left) --parallel 1
  (cd /tmp/p16 && python -m nanolp.sweep --out $R/runs/s8b --arm p16-lr3="--fix off --lr 3e-3" --seeds 0 \
    --steps 70000 --minutes $(left) --parallel 1)
  # o32 (failed at its first step in session 8; variants.py o32 then, --delta-fp32 since)
  python -m nanolp.sweep --out runs/s8b --arm o32-lr3="--fix off --lr 3e-3 --delta-fp32" --seeds 0 \
    --steps 70000 --minutes $(left) --parallel 1
  python -m nanolp.sweep --out runs/s8b --arm off-lr3="--fix off --lr 3e-3" --seeds 1 2 3 --steps 90000 \
    --minutes $(left) --parallel 1
) > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s8a runs/s8b --csv $OUT/s8.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
