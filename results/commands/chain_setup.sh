# Sourced by the session chains (s8_chain.sh, s9_chain.sh) as `. results/commands/chain_setup.sh "$@"`:
# OUT (what comes back from the device), MIN (this call's minutes, $1, default 9), R (the checkout), a record of the
# code that ran (runs/code.sha256, returned inside logs.tgz), and left, the minutes this call has left.
export OUT=${OUT:-out}; mkdir -p $OUT
export PYTHONUNBUFFERED=1
MIN=${1:-9}
START=$SECONDS
R=$PWD
mkdir -p runs; sha256sum kernels.py model.py train.py nanolp/*.py results/commands/variants.py > runs/code.sha256
left() { python -c "print(round($MIN - ($SECONDS - $START) / 60, 2))"; }
