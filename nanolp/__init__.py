"""nanolp: the pieces shared by train.py, analyze.py and the tests (data, diagnostics, kernel emulation)."""
