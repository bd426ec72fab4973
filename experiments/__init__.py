"""The studies' code: sweeps, benchmarks and measurements, each run as `python -m experiments.NAME` from the
repository's root (experiments/README.md). They import nanolp/, kernels.py and model.py, and the sweep train.py's
presets (their one home); nothing there imports them (analyze.py imports experiments.mechanism for --mechanism and
experiments.lr_curve for --table)."""
