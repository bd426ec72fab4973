"""The commands' parser, on the standard library alone (experiments/corpus.py runs without torch)."""

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse's parser for the commands here (train.py, analyze.py, experiments'): a malformed flag refused in one
    line, `prog: error: ...`, exit status 2, as each refuses every command that cannot run (argparse prints its usage
    first). prog is given: a command run in a test or by `python -m` would otherwise name the wrong program."""
    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)
