"""Where the forward's time goes: the forward alone with the fix off, the paper's shift alone (fix="paper"), the
fp32 O alone (fix "on"'s store: fix "off" with delta "fp32-o", since with no backward to follow flash_attention runs
fix "on" as fix "off") and both (fix="paper", delta="fp32-o"), at seq 4096, batch 4, 2048 channels, bf16, causal;
median ms.

    python -m experiments.forward_split > results/speed/forward_split.txt     # on a GPU
    python -m experiments.forward_split --fwd 128/8/2/maxnreg=128 64/4/2     # FWD_TUNING against candidates
    python -m experiments.forward_split --seq 16384 --fwd 128/8/2/maxnreg=128  # the same at another length

With --fwd, the forward at one head_dim (--head-dim, 128 by default) in each variant with kernels.py's FWD_TUNING
and with each candidate setting, side by side, beside torch SDPA's cuDNN forward (which has no fix), as a markdown
table; a candidate's column also says whether its outputs (O, lse and the fp32 O) have FWD_TUNING's bits. A candidate is
BLOCK_M/WARPS/STAGES as in FWD_TUNING, then optionally /maxnreg=R (Triton's cap on registers per thread, a
compile option) and /block_n=N (keys per tile; anything but kernels.TILE_N changes the numerics: the shift
looks for ties within one tile, and nanolp/emulate.py follows TILE_N). --seq sets the sequence length (4096 by
default). experiments/sass.py --fwd compiles the same settings for sm_90 on a CPU (results/speed/forward_d128_candidates.md).
"""
import argparse
from typing import NamedTuple, Optional

import torch

import kernels
from kernels import Numerics, flash_attention
from experiments.launch_variants import tuned
from nanolp.runconfig import Parser

VARIANTS = {"off": dict(fix="off"), "shift": dict(fix="paper"),
            "o32": dict(fix="off", numerics=Numerics(delta="fp32-o")),
            "both": dict(fix="paper", numerics=Numerics(delta="fp32-o"))}


class FwdConfig(NamedTuple):
    """A forward setting: FWD_TUNING's three numbers, Triton's maxnreg (None: no cap) and the key tile."""
    block_m: int
    warps: int
    stages: int
    maxnreg: Optional[int] = None
    block_n: int = kernels.TILE_N

    @classmethod
    def parse(cls, text):
        """From "BLOCK_M/WARPS/STAGES[/maxnreg=R][/block_n=N]", the form __str__ writes."""
        numbers, options, extra = text.split("/")[:3], text.split("/")[3:], {}
        expected = f"{text}: expected BLOCK_M/WARPS/STAGES[/maxnreg=R][/block_n=N]"
        for option in options:
            name, _, value = option.partition("=")
            if name not in ("maxnreg", "block_n") or not value.isdigit():
                raise argparse.ArgumentTypeError(expected)
            extra[name] = int(value)
        if len(numbers) != 3 or not all(n.isdigit() for n in numbers):
            raise argparse.ArgumentTypeError(expected)
        return cls(*map(int, numbers), **extra)

    def __str__(self):
        return "/".join([f"{self.block_m}/{self.warps}/{self.stages}"]
                        + ([f"maxnreg={self.maxnreg}"] if self.maxnreg else [])
                        + ([f"block_n={self.block_n}"] if self.block_n != kernels.TILE_N else []))


def forward_config(head_dim, config):
    """kernels.py's forward at head_dim launched with config inside the block, as FWD_TUNING is otherwise
    (experiments/launch_variants.py)."""
    return tuned(fwd={head_dim: (config.block_m, config.warps, config.stages)}, block_n=config.block_n,
                         maxnreg=config.maxnreg)


def inputs(D, N=4096, channels=2048):
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(4, channels // D, N, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3)]


def split():
    from triton.testing import do_bench
    for D in (64, 128):
        q, k, v = inputs(D)
        for name, options in VARIANTS.items():
            ms = do_bench(lambda: flash_attention(q, k, v, **options), return_mode="median")
            print(D, name, f"fwd {ms:.3f} ms")


def compare(D, candidates, N=4096):
    """Median ms of each variant with FWD_TUNING and with each candidate, and of SDPA cuDNN, as markdown, at
    sequence length N."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench
    q, k, v = inputs(D, N)
    configs = [FwdConfig(*kernels.FWD_TUNING[D])] + candidates
    print(f"head_dim {D}, seq {N}, batch 4, 2048 channels, bf16, causal; forward median ms "
          f"(same: O, lse and the fp32 O bit for bit as with FWD_TUNING {configs[0]})\n")
    print("| variant | " + " | ".join([f"{configs[0]} (FWD_TUNING)"] + list(map(str, candidates)))
          + " |\n|" + "---|" * (len(configs) + 1))
    for name, options in VARIANTS.items():
        cells, reference = [name], None
        for config in configs:
            with forward_config(D, config):
                out = kernels.forward(q, k, v, **options)
                ms = do_bench(lambda: flash_attention(q, k, v, **options), return_mode="median")
            if reference is None:
                reference = out
            same = all(torch.equal(a, b) for a, b in zip(out, reference))
            cells.append(f"{ms:.3f}" + ("" if config is configs[0] else " same" if same else " differs"))
        print("| " + " | ".join(cells) + " |", flush=True)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), return_mode="median")
    print(f"| torch SDPA cuDNN | {ms:.3f} |" + " |" * (len(configs) - 1))


def main():
    p = Parser(prog="python -m experiments.forward_split", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fwd", type=FwdConfig.parse, nargs="+", metavar="CONFIG",
                   help="forward settings to time beside FWD_TUNING's: BLOCK_M/WARPS/STAGES[/maxnreg=R][/block_n=N]")
    p.add_argument("--head-dim", type=int, default=128, choices=sorted(kernels.FWD_TUNING))
    p.add_argument("--seq", type=int, default=4096, help="sequence length with --fwd")
    args = p.parse_args()
    if args.seq < 1:
        p.error(f"--seq {args.seq}: a sequence length is at least 1")
    if not torch.cuda.is_available():
        p.error("timing needs a CUDA GPU")
    if args.fwd:
        compare(args.head_dim, args.fwd, args.seq)
    else:
        split()


if __name__ == "__main__":
    main()
