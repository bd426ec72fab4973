"""What a run's arm is and which settings a run can have, shared by train.py (which runs them) and analyze.py (which
names runs by the train.py flags that set them apart). The presets' values are train.py's (PRESETS)."""
import re
from dataclasses import asdict, fields

from kernels import Numerics, delta_reads

# The attention's numerics (kernels.Numerics): a run holds each field as a setting of its own (a flag, a key of
# config.json and summary.json).
NUMERICS = tuple(f.name for f in fields(Numerics))
# The plain attention, which every preset shares: no fix and no experiment, the numerics as kernels.Numerics
# declares them. The presets themselves, every other setting, open train.py (PRESETS): the functions here that
# need them take them as an argument, since nanolp never imports train.py.
COMMON = dict(fix="off", **asdict(Numerics()))
# The arm: every setting that decides a run's numbers (its numerics and its data order). The default name spells
# out each one that differs from the preset, --resume refuses to change any, summary.json records them all.
# Not in it: the run's length and intervals, and --device/--compile (where and how fast the same steps run).
ARM = ("preset", "attn", "fix", *NUMERICS, "pos", "lr", "warmup", "beta1", "beta2", "weight_decay", "grad_clip",
       "n_layer", "n_head", "n_embd", "block_size", "batch_size", "dtype", "data", "seed")
NAMED = ("preset", "attn", "fix", "seed")  # always in the name
# Settings that a run made before they existed did not have: it ran neither value (before Numerics.exponent the
# kernel's exponent was fused by ptxas in some tiles only). Their tables and figures say so instead of showing the
# default.
BEFORE_OPTION = ("exponent",)


def changed_settings(c, presets):
    """The settings of ARM, other than the NAMED ones, in which config c differs from its preset (of presets,
    train.PRESETS)."""
    preset = presets.get(c.get("preset"), presets["default"])   # (an old run's preset may be gone)
    return {k: c.get(k) for k in ARM if k not in NAMED and c.get(k) != preset.get(k)}


def flag(key):
    """The train.py flag that gives a setting."""
    return "--data (or $NANOLP_DATA)" if key == "data" else "--" + key.replace("_", "-")


def in_flags(message):
    """A kernel's message about its arguments in train.py's flags: a setting given as name=value (fix="on",
    delta="p") as --fix on, --delta p, and a name with an underscore (mantissa_bits) as its flag; a word that is
    also a setting's name (delta, exponent) stays a word."""
    names = "|".join(("fix", *NUMERICS))
    message = re.sub(rf"\b({names})=(['\"]?)([\w.-]+)\2", lambda m: f"{flag(m[1])} {m[3]}", message)
    return re.sub(rf"\b({'|'.join(name for name in NUMERICS if '_' in name)})\b", lambda m: flag(m[1]), message)


def check_config(c):
    """Every problem with a run's resolved settings c, one line each naming its flags; [] if the run can go.
    train.py checks before it makes a run folder, so that a bad setting neither leaves one behind nor fails
    after minutes of training (or, worse, trains and records a nonsense result)."""
    import torch   # only where a run is checked
    at_least = dict(steps=1, batch_size=1, n_layer=1, n_head=1, n_embd=1, block_size=1, warmup=0, log_interval=1,
                    eval_interval=1, diag_interval=1, ckpt_interval=1)
    problems = [f"{flag(k)} must be at least {low}, got {c[k]}" for k, low in at_least.items() if c[k] < low]
    problems += [f"{flag(k)} must be positive, got {c[k]}" for k in ("lr", "minutes")
                 if c[k] is not None and not c[k] > 0]
    ours = c["attn"] in ("kernel", "emulate")
    shape_ok = c["n_head"] >= 1 and c["n_embd"] >= 1
    if shape_ok and c["n_embd"] % c["n_head"]:
        problems.append(f"--n-embd {c['n_embd']} is not divisible by --n-head {c['n_head']}: each head takes "
                        f"n_embd / n_head channels")
    elif shape_ok and ours and c["n_embd"] // c["n_head"] not in (16, 32, 64, 128):   # the kernel's tile sizes
        problems.append(f"--attn {c['attn']} needs a head size (--n-embd / --n-head) of 16, 32, 64 or 128, "
                        f"got {c['n_embd']} / {c['n_head']} = {c['n_embd'] // c['n_head']}")
    try:   # the kernel's own rules for its options (kernels.Numerics, kernels.delta_reads), told in flags
        delta_reads(c["fix"], Numerics(**{k: c[k] for k in NUMERICS}))
    except ValueError as e:
        problems.append(in_flags(str(e)))
    experiments = [f"{flag(k)} {c[k]}" for k in ("fix", *NUMERICS) if c[k] != COMMON[k]]
    if experiments and not ours:
        problems.append(f"{', '.join(experiments)}: only our kernel has {'these' if len(experiments) > 1 else 'it'} "
                        f"(--attn kernel or emulate), not --attn {c['attn']}")
    if c["dtype"] == "fp32" and c["attn"] not in ("sdpa", "fp32"):
        problems.append(f"--dtype fp32 needs --attn sdpa or fp32: --attn {c['attn']} takes bf16 or fp16 only")
    if c["name"] in ("", ".", "..") or set(c["name"]) & {"/", "\\", "\0"}:
        problems.append(f"--name must be a plain folder name (no / or \\, not . or ..), got {c['name']!r}: the "
                        f"run folder is made inside --out")
    try:
        device = torch.device(c["device"])
    except RuntimeError:
        problems.append(f"--device {c['device']!r} is not a device torch knows (cpu, cuda, cuda:1, ...)")
    else:
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            problems.append(f"--device {c['device']}: this machine has {torch.cuda.device_count()} CUDA devices "
                            f"(torch {torch.__version__})")
        if c["attn"] == "sdpa-cudnn" and device.type != "cuda":
            problems.append(f"--attn sdpa-cudnn needs a CUDA device, not {c['device']}")
    return problems
