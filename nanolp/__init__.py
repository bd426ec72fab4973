"""nanolp: the library that train.py, analyze.py, the experiments and the tests import (data, runs, a run's
configuration, presets, diagnostics, the kernel's emulation, plots, the probe's tables, the CPU interpreter patch,
the sm_90 compile check).
It imports the top-level kernels.py and model.py, never experiments/."""
