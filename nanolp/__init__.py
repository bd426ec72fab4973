"""nanolp: the library that train.py, analyze.py, the experiments and the tests import (the commands' parser, data,
runs, a run's configuration and arm, diagnostics, the kernel's emulation, plots, the probe's tables, the CPU
interpreter patch, the sm_90 compile check).
It imports the top-level kernels.py (which imports nothing of this project); never model.py, train.py, analyze.py
or experiments/, which import it (the presets' values open train.py, the choices of --attn and --pos model.py; the
functions here that need them take them as arguments). model.py takes the kernel's emulation and its rule (which
attentions take fix and the numerics: emulate.kernel_only) from here."""
