"""Where ptxas put the warpgroup MMAs' waits relative to the exponentials in kernels_gluon.py's forward, read from
its SASS for sm_90 on a machine without a GPU (results/speed/gluon_forward.md).

    python -m experiments.gluon_sass [--head-dim 128] [--variants sync tma ws overlap]    # no TRITON_INTERPRET

For each variant at causal, fix "off" and "on": registers, spills, shared memory (experiments/compile_gluon_sm90.py's
compile of the launch), and the kernel's SASS as a sequence of runs of the instructions that order the loop:
HGMMA (an MMA instruction), ARRIVE (WARPGROUP.ARRIVE: MMAs issued), DEPBAR (WARPGROUP.DEPBAR: the wait for them),
EX2 (MUFU.EX2: an exponential), BAR (BAR.SYNC: a CTA or named barrier), SYNCS (mbarrier operations), TMA (UTMALDG),
LDG/STS (plain loads and shared stores), SETMAXREG (a warp partition resizing its registers); "EX2x32" is 32
in a row; other instructions left out.
"""
import argparse
import re
import tempfile

from experiments.compile_gluon_sm90 import compile_launch, launches, resources  # first: it asserts no TRITON_INTERPRET
from experiments.kernels_gluon import VARIANTS
import triton

EVENTS = {"HGMMA": "HGMMA", "WARPGROUP.ARRIVE": "ARRIVE", "WARPGROUP.DEPBAR": "DEPBAR", "MUFU.EX2": "EX2",
          "BAR.SYNC": "BAR", "SYNCS": "SYNCS", "UTMALDG": "TMA", "LDG": "LDG", "STS": "STS", "USETMAXREG": "SETMAXREG"}
OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]\s+)?([A-Z][A-Z0-9_.]*)")


def events(sass):
    """The SASS as runs of EVENTS, e.g. ['HGMMAx4', 'DEPBAR', 'EX2x32']."""
    runs = []
    for line in sass.splitlines():
        m = OPCODE.search(line)
        if not m:
            continue
        name = next((short for prefix, short in EVENTS.items() if m.group(1).startswith(prefix)), None)
        if name is None:
            continue
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    return [name if n == 1 else f"{name}x{n}" for name, n in runs]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head-dim", type=int, default=128, choices=(64, 128))
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS))
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90, head_dim {args.head_dim}, causal, seq 1000, batch 4, 2048 channels\n")
    with tempfile.TemporaryDirectory() as tmp:
        for variant, D, causal, fix, kernel, largs, meta in launches(args.variants):
            if D != args.head_dim or not causal:
                continue
            compiled = compile_launch(kernel, largs, meta)
            regs, stack, local, sass = resources(compiled.asm["cubin"], tmp)
            print(f"{variant} fix={fix}: {regs} registers, {local} STL/LDL, stack {stack} B, "
                  f"{compiled.metadata.shared // 1024} KiB shared, {compiled.metadata.num_warps} warps")
            print("    " + " ".join(events(sass)) + "\n")


if __name__ == "__main__":
    main()
