#!/bin/bash
# Session 10 (run as planned; results in results/research.md, session 10): the first installment of issue 7's seed study at the default. Session 9
# closed issue 5: plain bf16 at lr 1e-3 collapses (2 of 2 seeds, 94,798 and 110,503 steps), the control
# o32 cures it (2 of 2, 123,000+ steps), the paper's fix does not (2 of 2 collapse). Runs cannot cross sessions,
# and two side by side reach ~145,000 steps each in a session, so each GPU carries two seeds:
#   GPU 0: torch SDPA with the flash backend forced, seeds 0 and 1 (never run past 7,800 steps; does torch's own
#          flash kernel, which also casts O to bf16, collapse too?)
#   GPU 1: our kernel, fix off, seeds 2 and 3 (the rate).
# First, on GPU 0 in the first call only (~2 minutes): the GPU tests of the delta paths (delta_fp32 is new in
# kernels.py since session 9's runs; CPU-tested bit for bit) and the benchmark with ours_dfp32 beside ours, the fix,
# delta from P and SDPA, on an idle GPU.
# Call it three times back to back on one held nvidia-h200-x2, carry ["data"]: `bash results/commands/s10_chain.sh 9`,
# again with 9, then 9.4. Each call resumes what is unfinished.
. results/commands/chain_setup.sh "$@"
(
  export CUDA_VISIBLE_DEVICES=0
  if [ ! -d runs/s10a ]; then
    timeout 150 python -m pytest -q tests/test_kernels.py -k "delta or opcheck or compile" > $OUT/gpu_tests.txt 2>&1
    timeout 200 python -m nanolp.bench --seqs 1024 4096 16384 --out $OUT/bench_s10.csv > $OUT/bench.txt 2>&1
  fi
  python -m nanolp.sweep --out runs/s10a --arm flash="--attn sdpa-flash" --seeds 0 1 --minutes $(left)
) > $OUT/sweep_a.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  python -m nanolp.sweep --out runs/s10b --arm off="--fix off" --seeds 2 3 --minutes $(left)
) > $OUT/sweep_b.txt 2>&1 &
wait
python -m nanolp.sweep --collect runs/s10a runs/s10b --csv $OUT/s10.csv
tar czf $OUT/logs.tgz --exclude=ckpt runs
