"""What a run is: its settings (the presets, train.py's flags, its JSON files), checked, named, in today's spellings.

Which settings a run can have, and which of them make its arm (shared with analyze.py, which names runs by the
train.py flags that set them apart); train.py's command line (parser, parse_args); a run's settings resolved from the
presets, the flags and (on --resume) the run's own config.json, checked, named (resolve_config), and checked against
the machine (check_machine). The presets themselves are train.py's (PRESETS), the choices of --attn and --pos
model.py's: the functions here that need them take them as arguments, since nanolp never imports either. Where a
run is, its folder and the files in it: nanolp/runs.py, which imports this module, never the other way.

Runs never mix. The default name is <preset>-<attn>-fix<fix>, then a suffix for each setting of ARM that differs
from the preset's (-delta_p, -lr0.003, -bits3, ...), then -s<seed>: default-kernel-fixoff-delta_p-s0. A name
longer than MAX_NAME characters puts a hash of those settings in place of their suffixes. --resume continues a run
with its own config.json and refuses a flag of ARM that differs from it, and a config.json with a key or a type that
train.py does not write; --steps, --minutes, the intervals, --device and --compile may change (which command may
write which run folder: nanolp.runs.claim_folder). Every refusal is a RunError, which train.py prints before it
writes anything, one line per problem, exit status 2.

Older runs' files spell some settings otherwise; every reader gets them in today's spellings (as_current), and the
files, being data, stay as written.
"""

import difflib
import hashlib
import json
import math
import os
import re
import shlex
from dataclasses import asdict, fields
from pathlib import Path

import torch

from kernels import FIXES, Numerics, check_fix
from nanolp.cli import Parser   # (the commands import it from here)
from nanolp.data import PROBE_SEED, cache_name, text_path
from nanolp.emulate import OURS, kernel_only


class RunError(Exception):
    """A command that cannot run as given: a bad setting, or a run folder that it may not write or continue. The
    message says why and what to do, one line per problem; train.py prints it and exits with status 2."""


class DamagedFile(RunError):
    """A run folder's file that is there but cannot be read, as a disk that filled or a copy cut short leaves it:
    the message names it and says why, in one line. train.py refuses the run; analyze.py and the sweep leave the
    run out (nanolp.runs.load_runs)."""


# The attention's numerics (kernels.Numerics): a run holds each field as a setting of its own (a flag, a key of
# config.json and summary.json).
NUMERICS = tuple(f.name for f in fields(Numerics))
# The plain attention's numerics, which every preset shares: no experiment, the numerics as kernels.Numerics
# declares them.
PLAIN_NUMERICS = asdict(Numerics())
# The plain block, which every preset shares: GPT-2's (learned positions, no QK-norm; model.GPTConfig's options), as
# every run recorded before the block had options ran it
GPT2_BLOCK = {"pos": "learned", "qk_norm": False}
# The arm: every setting that decides a run's numbers (its numerics and its data order). The default name spells
# out each one that differs from the preset, --resume refuses to change any, summary.json records them all.
# Not in it: the run's length and intervals, and --device/--compile (where and how fast the same steps run).
ARM = ("preset", "attn", "fix", *NUMERICS, *GPT2_BLOCK, "lr", "warmup", "beta1", "beta2", "weight_decay",
       "grad_clip", "n_layer", "n_head", "n_embd", "block_size", "batch_size", "dtype", "data", "seed")
NAMED = ("preset", "attn", "fix", "seed")  # always in the name
# Settings that a run made before they existed did not have: it ran neither value (before Numerics.exponent the
# kernel's exponent was fused by ptxas in some tiles only). Their tables and figures say so instead of showing the
# default.
BEFORE_OPTION = ("exponent",)
# What a config.json holds besides the presets' settings, with the JSON type of each: train.py's names for the run
# and where it ran, what it recorded (the text's hash and vocabulary, the FLOPs, what computed attn, the code),
# experiments/late_stage.py's fork, and an older train.py's lr schedule (always "constant")
RECORDED = dict(preset=str, name=str, device=str, compile=str, data_sha1=str, vocab_size=int, flops_per_token=int,
                attn_impl=str, provenance=dict, forked_from=str, schedule=str)
# The settings that the presets leave None (not given), with the type they have when given
OPTIONAL = dict(minutes=float, data=str)
JSON_TYPES = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "an object"}
# A run's outcome as summary.json records it (runs.write_summary), each with its type, or null (no collapse; a loss
# that went non-finite; a run on the CPU)
OUTCOME = dict(collapsed=bool, collapse_step=int, collapse_minute=float, reason=str, steps=int, minutes=float,
               final_val_loss=float, final_train_loss=float, max_logit=float, tokens_per_s=float, mfu=float,
               peak_mem_gb=float)


def as_shipped(settings):
    """Whether a run (its config and summary, or its runs.csv row) ran the kernel as it ships: it records the
    exponent (BEFORE_OPTION), which the earlier kernels' runs did not have. README's table and headline figure hold
    these runs; results/README.md and the second figure the earlier ones."""
    return all(settings.get(key) is not None for key in BEFORE_OPTION)


def parse_args(argv, presets, choices):
    """train.py's command line (argv; None: sys.argv's), with --help showing the defaults of the --preset it gives.
    presets: train.PRESETS; choices: the values model.py offers for --attn and --pos (attn=..., pos=...)."""
    return parser(presets, choices, preset_given(argv, presets)).parse_args(argv)


def preset_given(argv, presets):
    """The --preset of a command line (default: "default"), so that --help shows that preset's defaults; a bad
    value is left to the whole parser to refuse."""
    pre = Parser(prog="train.py", add_help=False, allow_abbrev=False)
    pre.add_argument("--preset")
    preset = pre.parse_known_args(argv)[0].preset
    return preset if preset in presets else "default"


def parser(presets, choices, preset="default"):
    """The flags. Every default is None, so that a flag the user gave can be told from one they did not (the
    preset's value); --help shows the values of `preset`, the one on the command line."""
    default = presets[preset]
    def show(key):   # a default as it reads: 200,000
        value = default[key]
        return f" (default {value:,})" if isinstance(value, int) else f" (default {value})"
    p = Parser(
        prog="train.py", allow_abbrev=False,   # a flag in full, as config.json and the studies' flags spell it
        description="Train a char-level GPT in bf16 and watch flash attention's rounding collapse it (--fix off), "
                    f"or not (--fix on). The defaults shown are the {preset} preset's (--preset tiny --help: the "
                    "tiny preset's). Details: the top of train.py and README.md.")
    demo = p.add_argument_group("the demo")
    demo.add_argument("--fix", choices=FIXES, help="off: plain bf16 flash attention, which collapses; on: the fix, "
                      "the backward's delta read from the forward's fp32 O, which trains through; paper: the paper's "
                      "rule (a tied row max shifted up), which collapses too (with --delta fp32-o: the two together)"
                      + show("fix"))
    demo.add_argument("--attn", choices=choices["attn"], help="what computes attention: kernel, our Triton flash "
                      "attention (kernels.py; on a CPU device, its PyTorch emulation); emulate, that emulation "
                      "anywhere; sdpa, torch's scaled_dot_product_attention (torch picks its backend), sdpa-flash or "
                      "sdpa-cudnn, one backend of it; fp32, plain attention in fp32, the control that does not "
                      "round. --fix and the numerics' experiments apply to kernel and emulate only; --pos and "
                      "--qk-norm to every attention" + show("attn"))
    demo.add_argument("--seed", type=int, help="seed of the initial weights and of the order of the training "
                                               "batches" + show("seed"))
    demo.add_argument("--steps", type=int, metavar="N", help="training steps, one batch each" + show("steps"))
    demo.add_argument("--minutes", type=float, metavar="M", help="stop after this many minutes of training, "
                                                                 "counted over resumes (default: no limit)")
    demo.add_argument("--data", metavar="FILE", help="the text to train on, UTF-8 (default: $NANOLP_DATA, else "
                      "TinyShakespeare, downloaded on first use; data/README.md)")
    sizes = "; ".join(f"{name}, {what} ({presets[name]['n_layer']} layers of {presets[name]['n_embd']} channels, "
                      f"{presets[name]['steps']:,} steps)" for name, what in (
                          ("default", "the demo, for one GPU"), ("tiny", "a smoke run for a CPU"),
                          ("gpt2", "GPT-2 small's shape"), ("corpus", "the default on data/corpus/input.txt, a text "
                                                                      "~100x TinyShakespeare")))
    demo.add_argument("--preset", choices=presets, help=f"the model's size and the run's length, which set the "
                                                        f"other defaults: {sizes} (default default)")
    demo.add_argument("--out", metavar="DIR", help="the folder that run folders go in" + show("out"))
    demo.add_argument("--name", help="the run's folder in --out (default: made from the settings that set the run "
                                     "apart from its preset, e.g. default-kernel-fixoff-s0)")
    demo.add_argument("--resume", action="store_true", help="continue the run in --out/--name from its latest "
                      "checkpoint (without --name, the run's own flags make its name)")
    training = p.add_argument_group("training")
    training.add_argument("--lr", type=float, help="learning rate (AdamW), constant after the warmup" + show("lr"))
    training.add_argument("--warmup", type=int, metavar="N", help="steps over which the learning rate rises "
                                                                  "linearly to --lr" + show("warmup"))
    training.add_argument("--batch-size", type=int, metavar="N", help="sequences per step" + show("batch_size"))
    training.add_argument("--dtype", choices=["bf16", "fp32"], help="bf16: the model runs under bfloat16 autocast, "
                          "the setting that fails; fp32: no autocast (with --attn sdpa or fp32 only)" + show("dtype"))
    training.add_argument("--compile", choices=["off", "default", "reduce-overhead"],
                          help="torch.compile's mode; reduce-overhead records CUDA graphs, much faster for a model "
                               "this small (default: reduce-overhead on a GPU, off on a CPU)")
    training.add_argument("--device", help="where to train: cpu, cuda, cuda:1, ... (default: cuda if there is "
                                           "one, else cpu)")
    for interval, what in (("log", "rows of log.csv (the training loss; a row also at each of the others)"),
                           ("eval", "validation losses"),
                           ("diag", "diagnostics (each layer's max attention logit, W_Q and W_K norms, ...: "
                                    "nanolp/diagnostics.py)"),
                           ("ckpt", "checkpoints (the newest few kept in ckpt/; --resume starts from the newest "
                                    "good one)")):
        training.add_argument(f"--{interval}-interval", type=int, metavar="N",
                              help=f"steps between {what}" + show(f"{interval}_interval"))
    shape = p.add_argument_group("model shape")
    for dim, what in (("n_layer", "transformer blocks"), ("n_head", "attention heads per block"),
                      ("n_embd", "channels; each head gets n_embd / n_head"),
                      ("block_size", "context length, in characters")):
        shape.add_argument("--" + dim.replace("_", "-"), type=int, metavar="N", help=what + show(dim))
    experiments = p.add_argument_group("experiments", "the attention's numerics (kernels.Numerics; --attn kernel "
                                                      "or emulate only) and the model, to test the mechanism")
    for f in fields(Numerics):   # a flag per field, with the help and values it declares
        experiments.add_argument("--" + f.name.replace("_", "-"), type=f.type, choices=f.metadata["choices"],
                                 help=f.metadata["help"] + show(f.name))
    experiments.add_argument("--pos", choices=choices["pos"], help="positions: learned (GPT-2's table), rope "
                             "(rotary, a modern block's), or none, so that layer 0 sees only characters and every "
                             "repeat of a row's best match ties exactly" + show("pos"))
    experiments.add_argument("--qk-norm", action="store_true", default=None, help="RMSNorm on each head's queries "
                             "and keys, with a learned gain per channel (a modern block's; default off)")
    return p


def changed_settings(c, presets):
    """The settings of ARM, other than the NAMED ones, in which config c differs from its preset (of presets,
    train.PRESETS)."""
    preset = presets.get(c.get("preset"), presets["default"])   # (an old run's preset may be gone)
    return {k: c.get(k) for k in ARM if k not in NAMED and c.get(k) != preset.get(k)}


def arm_flags(recorded, presets):
    """The train.py flags that set a run apart from its preset, e.g. "--fix off", "--fix on --lr 0.003", "--attn
    sdpa" (recorded: its settings, summary.json's over config.json's; presets: train.PRESETS): --preset and --attn
    where they are not the default, --fix for our attention, then the settings of ARM that differ from the preset
    (changed_settings), less the kernel's options for the torch attentions, which ignore them. A setting the run did
    not record reads as its preset's."""
    settings = with_preset(recorded, presets)
    preset = settings["preset"]
    ours = settings["attn"] in OURS
    flags = ([] if preset == "default" else [f"--preset {preset}"]) + (
        [] if settings["attn"] == presets["default"]["attn"] else [f"--attn {settings['attn']}"]) + (
        [f"--fix {settings['fix']}"] if ours else [])
    changed = changed_settings(settings, presets)
    return " ".join(flags + [flag_text(k, v) for k, v in changed.items() if ours or k not in NUMERICS])


def with_preset(recorded, presets):
    """A run's settings (recorded: summary.json's over config.json's) over its preset's (presets: train.PRESETS; a
    preset gone since, the default's): a setting the run did not record reads as its preset's."""
    preset = recorded.get("preset") or "default"
    return {**presets.get(preset, presets["default"]), **{k: v for k, v in recorded.items() if v is not None},
            "preset": preset}


def flag_text(key, value):
    """A setting as its train.py flag, a shell's words: --lr 3e-3, --pos rope, --qk-norm, --data 'my text.txt'."""
    name = "--" + key.replace("_", "-")
    if isinstance(value, bool):   # a switch (--qk-norm): on where it differs from the preset, which has it off
        return name
    return f"{name} {number_text(value)}" if isinstance(value, float) else f"{name} {shlex.quote(str(value))}"


def number_text(value):
    """A float as the studies write it in their flags: 3e-3, 1e-2, 2.5e-3, 0.95, 100 (below 0.1 in a power of ten's
    form where that is no longer)."""
    mantissa, exponent = f"{value:e}".split("e")
    powered = f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
    return powered if abs(value) < 0.1 and len(powered) <= len(f"{value:g}") else f"{value:g}"


def numerics(c):
    """The attention's numerics (kernels.Numerics) that a run's settings c hold."""
    return Numerics(**{k: c[k] for k in NUMERICS})


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
    at_least = dict(steps=1, batch_size=1, n_layer=1, n_head=1, n_embd=1, block_size=1, warmup=0, log_interval=1,
                    eval_interval=1, diag_interval=1, ckpt_interval=1)
    problems = [f"{flag(k)} must be at least {low}, got {c[k]}" for k, low in at_least.items() if c[k] < low]
    if not 0 <= c["seed"] < PROBE_SEED:   # (the seed above them draws the diagnostics' own batches)
        problems.append(f"--seed must be 0 to {PROBE_SEED - 1:,}, got {c['seed']}")
    # finite too: an inf --lr makes every weight non-finite at the first step, and config.json is JSON, which has no inf
    problems += [f"{flag(k)} must be a positive, finite number, got {c[k]}" for k in ("lr", "minutes")
                 if c[k] is not None and not 0 < c[k] < math.inf]
    # AdamW's first step divides the lr by 1 - beta1 (its bias correction) in float32, where a larger one overflows
    largest_lr = torch.finfo(torch.float32).max * (1 - c["beta1"])
    if math.isfinite(c["lr"]) and c["lr"] > largest_lr:
        problems.append(f"--lr {c['lr']:g} overflows float32 in AdamW's first step, which divides it by 1 - beta1: "
                        f"it must be at most {largest_lr:.3g}")
    ours = c["attn"] in OURS
    shape_ok = c["n_head"] >= 1 and c["n_embd"] >= 1
    if shape_ok and c["n_embd"] % c["n_head"]:
        problems.append(f"--n-embd {c['n_embd']} is not divisible by --n-head {c['n_head']}: each head takes "
                        f"n_embd / n_head channels")
    elif shape_ok and ours and c["n_embd"] // c["n_head"] not in (16, 32, 64, 128):   # the kernel's tile sizes
        problems.append(f"--attn {c['attn']} needs a head size (--n-embd / --n-head) of 16, 32, 64 or 128, "
                        f"got {c['n_embd']} / {c['n_head']} = {c['n_embd'] // c['n_head']}")
    try:   # the kernel's own rules for its options (kernels.Numerics, kernels.check_fix), told in flags
        check_fix(c["fix"], numerics(c))
    except ValueError as e:
        problems.append(in_flags(str(e)))
    if experiments := [f"{flag(k)} {c[k]}" for k in kernel_only(c["attn"], c)]:
        problems.append(f"{', '.join(experiments)}: only our kernel has {'these' if len(experiments) > 1 else 'it'} "
                        f"(--attn kernel or emulate), not --attn {c['attn']}")
    if c["dtype"] == "fp32" and c["attn"] not in ("sdpa", "fp32"):
        problems.append(f"--dtype fp32 needs --attn sdpa or fp32: --attn {c['attn']} trains in bf16 only")
    if not c["out"]:   # (an empty --out would put the run folder in the current directory)
        problems.append("--out is empty: give the folder that run folders go in")
    if c["data"] == "":   # (resolve_config leaves an empty --data as it is: resolved, it would be this folder)
        problems.append("--data is empty: give a text file's path, or neither for TinyShakespeare")
    if c["name"] in ("", ".", "..") or set(c["name"]) & {"/", "\\", "\0"}:
        problems.append(f"--name must be a plain folder name (no / or \\, not . or ..), got {c['name']!r}: the "
                        f"run folder is made inside --out")
    try:
        device = torch.device(c["device"])
    except RuntimeError:
        problems.append(f"--device {c['device']!r} is not a device torch knows (cpu, cuda, cuda:1, ...)")
    else:
        if device.type not in ("cpu", "cuda"):
            problems.append(f"--device {c['device']}: train.py runs on a CPU or a CUDA device (cpu, cuda, cuda:1, "
                            f"...), not {device.type}")
        elif device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            problems.append(f"--device {c['device']}: this machine has {torch.cuda.device_count()} CUDA devices "
                            f"(torch {torch.__version__})")
        if c["attn"] == "sdpa-cudnn" and device.type != "cuda":
            problems.append(f"--attn sdpa-cudnn needs a CUDA device, not {c['device']}")
    return problems

# a setting in a name: -<label><number>, -<label>_<word>
LABELS = dict(mantissa_bits="bits", block_size="block", batch_size="batch", weight_decay="wd", grad_clip="clip")
MAX_NAME = 80


def suffix(key, value):
    """How a run name spells one setting (LABELS)."""
    label = LABELS.get(key, key)
    if isinstance(value, bool):   # a switch: its name when on (-qk_norm), no_ and its name when off
        return label if value else "no_" + label
    if isinstance(value, (int, float)):
        return f"{label}{'_' if label[-1].isdigit() else ''}{value!r}"   # repr: the shortest exact spelling
    if key == "data" and value is not None:
        value = cache_name(value)
    return label + "_" + re.sub(r"[^\w.+-]", "_", str(value))


def run_name(c, presets):
    """The default name: <preset>-<attn>-fix<fix>, a suffix per changed setting, -s<seed> (as experiments/sweep.py
    ends its names, so the arm is the name less -s<seed>); past MAX_NAME characters a hash replaces the suffixes."""
    changed = changed_settings(c, presets)
    head, tail = f"{c['preset']}-{c['attn']}-fix{c['fix']}", f"-s{c['seed']}"
    name = head + "".join(f"-{suffix(k, v)}" for k, v in changed.items()) + tail
    if len(name) > MAX_NAME:
        digest = hashlib.sha1(json.dumps(changed, sort_keys=True).encode()).hexdigest()[:10]
        name = f"{head}-{digest}{tail}"
    return name


def describe(c, presets):
    """A run's arm in words: its NAMED settings and the ones that differ from its preset (and, where attn kernel
    runs as its emulation, that)."""
    settings = {k: c.get(k) for k in NAMED} | changed_settings(c, presets)
    if c.get("attn_impl", c["attn"]) != c["attn"]:
        settings["attn"] = f"{c['attn']} (on {c['device']}: its PyTorch emulation, nanolp/emulate.py)"
    return ", ".join(f"{k} {v}" for k, v in settings.items())


def resolve_config(args, presets):
    """The run's settings: its preset's (of presets, train.PRESETS), then the flags given, checked (check_config).
    On --resume the run's own config.json replaces the preset (which only fills in settings added after the run
    started), and a flag of ARM that differs from it is refused, as is a config.json that train.py did not write so
    (config_problems). RunError names every problem."""
    given = {k: v for k, v in vars(args).items() if v is not None and k != "resume"}
    preset = given.get("preset", "default")
    own = presets[preset].get("data")   # a preset's own text (--preset corpus), which $NANOLP_DATA does not replace
    if "data" not in given and not own and os.environ.get("NANOLP_DATA"):
        given["data"] = os.environ["NANOLP_DATA"]   # the text is part of the arm: recorded as if --data gave it
    if given.get("data"):   # (an empty one is refused: check_config)
        given["data"] = str(Path(given["data"]).resolve())   # one spelling per file, from wherever train.py runs
        if own and given["data"] == str(text_path(own).resolve()):
            del given["data"]   # the preset's own text, however it is spelled: the preset's arm
    config = {**presets[preset], "preset": preset, **given}
    config.setdefault("name", run_name(config, presets))
    problems = []
    if args.resume:
        run_dir = Path(config["out"]) / config["name"]
        saved = read_json(run_dir / "config.json")
        if not (run_dir / "config.json").exists():
            raise RunError(f"--resume: no run at {run_dir} (no config.json)")
        if not saved:   # (read_json's {} is a file that is there but holds {})
            raise RunError(f"--resume: {run_dir / 'config.json'} holds no settings, so the run cannot be continued "
                           f"as it started: restore its settings, or start a new run with another --name; nothing "
                           f"changed")
        if damage := config_problems(run_dir / "config.json", saved, presets):   # (the checks below would trip on it)
            raise RunError("\n".join(damage))
        ran = as_ran(saved, presets)
        problems += [f"--resume {run_dir}: {flag(k)}: the run has {ran.get(k)!r}, this command {given[k]!r}, which "
                     f"would change its numerics or data order (leave it out to continue the run as it was, or "
                     f"start a new run without --resume)" for k in ARM if k in given and given[k] != ran.get(k)]
        config = {**ran, **given}
    config.setdefault("device", "cuda" if torch.cuda.is_available() else "cpu")
    # CUDA graphs: without them a step of a model this small waits on kernel launches
    config.setdefault("compile", "reduce-overhead" if config["device"].startswith("cuda") else "off")
    problems += check_config(config)
    if problems:
        raise RunError("\n".join(problems))
    return config


def config_problems(path, saved, presets):
    """Every problem of a run's config.json (saved, as read_json read it from path), one line each naming the file:
    a key that train.py does not write, or a value of another type than it writes (as an edit by hand leaves them:
    "n_layers": 4, "n_layer": "two"), or without the preset and the name that every run records; [] if there is
    none. A number may be an integer where train.py writes a float, and the settings of OPTIONAL may be null."""
    settings = presets["default"]   # (every preset has every setting)
    problems = [f'{path}: no "{key}", which train.py records for every run' for key in ("preset", "name")
                if key not in saved]
    for key, value in saved.items():
        if key not in settings and key not in RECORDED:
            guess = difflib.get_close_matches(key, [*settings, *RECORDED], n=1)
            problems.append(f'{path}: unknown key "{key}"' + (f' (did you mean "{guess[0]}"?)' if guess else ""))
            continue
        kind = RECORDED.get(key) or OPTIONAL.get(key) or type(settings[key])
        if not (type(value) is kind or (kind is float and type(value) is int) or (value is None and key in OPTIONAL)):
            problems.append(f'{path}: "{key}" is {json.dumps(value)}, not {JSON_TYPES[kind]}')
    return problems


def as_ran(saved, presets):
    """A run's config.json with what it lacks (a setting added after it started) filled in from its preset."""
    return {**presets.get(saved.get("preset"), presets["default"]), **saved}


# A step of the default preset on a CPU, in seconds: 42-50, measured on two cores. Another shape's step is estimated
# from it in proportion to their FLOPs (step_flops).
CPU_STEP_S = (42, 50)


def check_machine(c, args, presets):
    """RunError, before anything is built, for a GPU without bf16 (compute capability below 8.0: a T4, a V100), where
    bf16 training cannot run; and for a preset sized for a GPU on a machine without CUDA: there a step takes most of
    a minute and a run months. An explicit --device cpu trains it anyway, and --resume continues a run on the
    device it ran on (its config.json's)."""
    if c["device"].startswith("cuda") and c["dtype"] == "bf16" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(c["device"])
        if major < 8:
            raise RunError(f"this GPU ({torch.cuda.get_device_name(c['device'])}, compute capability {major}.{minor}) "
                           f"has no bf16, the precision whose failure this project trains: it takes compute "
                           f"capability 8.0 or later (an A100, RTX 30xx or 40xx, L4, H100); on this machine's CPU: "
                           f"python train.py --preset tiny --device cpu")
    if c["preset"] == "tiny" or c["device"] != "cpu" or args.device is not None or args.resume:
        return
    step = [seconds * step_flops(c) / step_flops(presets["default"]) for seconds in CPU_STEP_S]
    kept = ("attn", "fix", *NUMERICS, *GPT2_BLOCK, "data", "seed")   # the arm, less the GPU preset's size and rate
    given = {k: getattr(args, k, None) for k in kept}
    spelled = lambda k: "--data" if k == "data" else flag(k)
    tiny = " ".join(["python train.py --preset tiny"] + [spelled(k) if v is True else f"{spelled(k)} {v}"
                                                         for k, v in given.items() if v is not None])
    raise RunError(f"the {c['preset']} preset is sized for a GPU and this machine has no CUDA device: a step takes "
                   f"about {span(*step)} on two CPU cores, its {c['steps']:,} steps "
                   f"{span(*(seconds * c['steps'] for seconds in step))} (--device cpu trains it here anyway); a smoke "
                   f"run of seconds: {tiny}")


def step_flops(c):
    """A step's training FLOPs with settings c, as model.GPT.flops_per_token counts them but without the embeddings
    (their size is the text's vocabulary, not read yet, and a small part): 6 x 12 n_embd^2 weights per layer, and
    the attention's 12 n_embd T, per token."""
    d, T = c["n_embd"], c["block_size"]
    return c["batch_size"] * T * c["n_layer"] * (72 * d * d + 12 * d * T)


def span(low, high):
    """Seconds from low to high in words, in the largest unit that high holds at least twice: 42-50 s, 97-116 days."""
    units = (("days", 86400), ("hours", 3600), ("minutes", 60))
    unit, size = next(((unit, size) for unit, size in units if high >= 2 * size), ("s", 1))
    digits = 0 if high >= 10 * size else 1
    return f"{low / size:,.{digits}f}-{high / size:,.{digits}f} {unit}"


def read_json(path):
    """A run's config.json or summary.json, its settings in today's spellings (as_current): {} if there is none,
    DamagedFile if it cannot be parsed."""
    if not path.exists():
        return {}
    try:
        value = json.loads(path.read_text())
    except ValueError as e:   # not JSON, or not even UTF-8 text
        raise DamagedFile(f"{path} cannot be parsed as JSON ({e})") from None
    except OSError as e:      # a folder of that name, or no permission to read it
        raise DamagedFile(f"{path} cannot be read ({e.strerror})") from None
    if not isinstance(value, dict):   # (train.py writes an object)
        raise DamagedFile(f"{path} holds JSON but not an object")
    if path.name == "summary.json" and (problems := summary_problems(value)):
        raise DamagedFile(f"{path}: " + "; ".join(problems))
    return as_current(value)


def summary_problems(summary):
    """What in a summary.json no train.py wrote, as an edit by hand leaves it: an outcome of another type than
    OUTCOME's ("steps": "150000"), a collapse without its step, a setting that is not one value ("fix": ["on"])."""
    problems = [f'"{key}" is {json.dumps(summary.get(key))}, not {JSON_TYPES[kind]}' for key, kind in OUTCOME.items()
                if not (summary.get(key) is None or type(summary[key]) is kind
                        or (kind is float and type(summary[key]) is int))]
    if summary.get("collapsed") is True and summary.get("collapse_step") is None:
        problems.append('"collapsed" is true without a "collapse_step"')
    problems += [f'"{key}" is {json.dumps(summary[key])}, not one value' for key in ARM
                 if isinstance(summary.get(key), (list, dict))]
    return problems


def as_current(settings):
    """A run's settings as an older train.py wrote them (a config.json, a summary.json, a row of runs.csv, typed or
    as text), in today's spellings; every reader of those files gets them through here. What the committed runs
    (results/) hold: what delta reads as two switches, delta_from_p ("p") and delta_fp32 ("fp32-o"), now the one
    setting delta; precision "paper", the paper's rounding points under autocast, now "autocast", and an arm's
    flags that said so; no setting of the block's, which they ran as GPT2_BLOCK. Today's settings come back
    unchanged."""
    settings = dict(settings)
    if "attn" in settings:   # (a run's settings, not another table's row)
        settings = {**GPT2_BLOCK, **settings}
    if {"delta_from_p", "delta_fp32"} & settings.keys():
        from_p, fp32 = (settings.pop(key, False) in (True, "True") for key in ("delta_from_p", "delta_fp32"))
        settings["delta"] = "p" if from_p else "fp32-o" if fp32 else "o"   # (train.py refused both)
    if settings.get("precision") == "paper":
        settings["precision"] = "autocast"
    if isinstance(settings.get("flags"), str):
        for old, new in ((r"--delta-from-p\b", "--delta p"), (r"--precision paper\b", "--precision autocast")):
            settings["flags"] = re.sub(old, new, settings["flags"])
    return settings
