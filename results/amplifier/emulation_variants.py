"""train.py with the emulation's "fa2" forward patched (--attn emulate, so CPU runs); the variants of the rows of
tiny_cpu_runs.csv whose `variant` column names this file.

    NORM=1 python results/amplifier/emulation_variants.py --preset tiny --attn emulate --device cpu \\
        --mantissa-bits 1 --fix off --steps 4000 --name p1-off-norm
    ALWAYS=1 NORM=1 python results/amplifier/emulation_variants.py ... --fix paper --name p1-paper-shift-all-norm

NORM=1: l sums the rounded P, so O's weights sum to one after rounding. ALWAYS=1 (with --fix paper): every tile's
row max is shifted, not only tied ones, so no P is exactly 1 in any row. With P rounded coarsely these remove the
two one-signed terms of O besides ties (P rounded low on average against an unrounded l; the row max, P = 1
exactly, never rounded); the patches assert that the emulation still has the lines they replace.
"""
import inspect
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import nanolp.emulate as E  # noqa: E402
import train  # noqa: E402


def patch(function, old, new):
    """Redefine `function` in nanolp.emulate with `old` (which must be in its source) replaced by `new`."""
    src = inspect.getsource(function)
    assert old in src, f"nanolp/emulate.py changed: update the patch of {function.__name__}"
    exec(src.replace(old, new), E.__dict__)


if os.environ.get("NORM") == "1":
    patch(E.forward,
          "            l = l * alpha + _rowsum(P)\n"
          "            acc = acc * alpha.unsqueeze(-1) + _dot(_round(low(P), dtype), vt)"
          "   # P rounded right before P V",
          "            Pr = _round(low(P), dtype)\n            l = l * alpha + _rowsum(Pr)\n"
          "            acc = acc * alpha.unsqueeze(-1) + _dot(Pr, vt)")
if os.environ.get("ALWAYS") == "1":
    patch(E.shifted_max, "    tied = ((n_near > 1) | across) & (r > -math.inf)", "    tied = r > -math.inf")
train.main(sys.argv[1:])
