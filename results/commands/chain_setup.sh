# Sourced by the session chains (s8_chain.sh on) as `. results/commands/chain_setup.sh "$@"`:
# OUT (what comes back from the device), MIN (this call's minutes, $1, default 9), R (the checkout), a record of the
# code that ran (runs/code.sha256, returned inside logs.tgz), and left, the minutes this call has left.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
START=$SECONDS
R=$PWD
mkdir -p runs; sha256sum kernels.py model.py train.py nanolp/*.py results/commands/variants.py > runs/code.sha256
left() { python -c "print(round($MIN - ($SECONDS - $START) / 60, 2))"; }
# run_jobs TAG: the jobs in JOBS ("arm|train.py flags|seeds", in priority order), one per GPU found, each a sweep of
# its seeds side by side in runs/TAG-<gpu> until this call's minutes run out; then one CSV and the logs in $OUT.
run_jobs() {
  local gpus=$(nvidia-smi -L | wc -l) i arm flags seeds
  for ((i = 0; i < gpus && i < ${#JOBS[@]}; i++)); do
    IFS='|' read -r arm flags seeds <<< "${JOBS[$i]}"
    CUDA_VISIBLE_DEVICES=$i python -m nanolp.sweep --out runs/$1-$i --arm "$arm=$flags" --seeds $seeds \
      --minutes $(left) > $OUT/sweep_$i.txt 2>&1 &
  done
  wait
  python -m nanolp.sweep --collect runs/$1-* --csv $OUT/$1.csv
  tar czf $OUT/logs.tgz --exclude=ckpt runs
}
