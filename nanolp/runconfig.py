"""A run's settings, before any training: which settings a run can have and which of them make its arm (shared
with analyze.py, which names runs by the train.py flags that set them apart); resolved from the presets, the flags
and (on --resume) the run's own config.json, checked, named; and its folder claimed. train.py calls
resolve_config, then claim_folder.

Runs never mix. The default name is <preset>-<attn>-fix<fix>, then a suffix for each setting of ARM that differs
from the preset's (-delta_p, -lr0.003, -bits3, ...), then -s<seed>: default-kernel-fixoff-delta_p-s0. A name
longer than MAX_NAME characters puts a hash of those settings in place of their suffixes. A new run refuses a
folder that holds a run's result (a checkpoint or summary.json) and replaces an attempt that stopped before its
first checkpoint. --resume continues a run with its own config.json and refuses a flag of ARM that differs from it,
a config.json with a key or a type that train.py does not write (and a text whose content changed, or a checkpoint
that the config's model does not fit: train.py); --steps, --minutes, the intervals, --device and --compile may
change. A collapsed run is not resumed: the collapse is its result. No command touches a folder that a live run is
writing (nanolp.runs.locked: its lock file holds the run's process id). Every refusal is a RunError, which train.py
prints before it writes anything, one line per problem, exit status 2.
"""

import difflib
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict, fields
from pathlib import Path

import torch

from kernels import Numerics, check_fix
from nanolp.emulate import OURS, kernel_only
from nanolp.runs import DAMAGED, GPT2_BLOCK, RunError, latest_checkpoint, read_json


# The attention's numerics (kernels.Numerics): a run holds each field as a setting of its own (a flag, a key of
# config.json and summary.json).
NUMERICS = tuple(f.name for f in fields(Numerics))
# The plain attention's numerics, which every preset shares: no experiment, the numerics as kernels.Numerics
# declares them. The presets themselves, every setting, are train.py's (PRESETS): the functions here that need
# them take them as an argument, since nanolp never imports train.py.
PLAIN_NUMERICS = asdict(Numerics())
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
    at_least = dict(steps=1, batch_size=1, n_layer=1, n_head=1, n_embd=1, block_size=1, warmup=0, log_interval=1,
                    eval_interval=1, diag_interval=1, ckpt_interval=1)
    problems = [f"{flag(k)} must be at least {low}, got {c[k]}" for k, low in at_least.items() if c[k] < low]
    problems += [f"{flag(k)} must be positive, got {c[k]}" for k in ("lr", "minutes")
                 if c[k] is not None and not c[k] > 0]
    ours = c["attn"] in OURS
    shape_ok = c["n_head"] >= 1 and c["n_embd"] >= 1
    if shape_ok and c["n_embd"] % c["n_head"]:
        problems.append(f"--n-embd {c['n_embd']} is not divisible by --n-head {c['n_head']}: each head takes "
                        f"n_embd / n_head channels")
    elif shape_ok and ours and c["n_embd"] // c["n_head"] not in (16, 32, 64, 128):   # the kernel's tile sizes
        problems.append(f"--attn {c['attn']} needs a head size (--n-embd / --n-head) of 16, 32, 64 or 128, "
                        f"got {c['n_embd']} / {c['n_head']} = {c['n_embd'] // c['n_head']}")
    try:   # the kernel's own rules for its options (kernels.Numerics, kernels.check_fix), told in flags
        check_fix(c["fix"], Numerics(**{k: c[k] for k in NUMERICS}))
    except ValueError as e:
        problems.append(in_flags(str(e)))
    if experiments := [f"{flag(k)} {c[k]}" for k in kernel_only(c["attn"], c)]:
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
        text = Path(value)
        value = text.parent.name if text.stem == "input" else text.stem   # as nanolp/data.py names its cache
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
    if "data" not in given and os.environ.get("NANOLP_DATA"):
        given["data"] = os.environ["NANOLP_DATA"]   # the text is part of the arm: recorded as if --data gave it
    if "data" in given:
        given["data"] = str(Path(given["data"]).resolve())   # one spelling per file, from wherever train.py runs
    preset = given.get("preset", "default")
    config = {**presets[preset], "preset": preset, **given}
    config.setdefault("name", run_name(config, presets))
    problems = []
    if args.resume:
        run_dir = Path(config["out"]) / config["name"]
        saved = read_json(run_dir / "config.json")
        if not saved:
            raise RunError(f"--resume: no run at {run_dir} (no config.json)")
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
    "n_layers": 4, "n_layer": "two"); [] if there is none. A number may be an integer where train.py writes a
    float, and the settings of OPTIONAL may be null."""
    settings = presets["default"]   # (every preset has every setting)
    problems = []
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


def claim_folder(run_dir, c, resume, presets):
    """Refuse (RunError) unless this command may write run_dir, whose lock it holds. A checkpoint or a summary.json
    is a run's result, never replaced: a new run refuses such a folder, and --resume continues it, unless it
    collapsed (the collapse is the result; continuing would write over it). An attempt that stopped before its
    first checkpoint has nothing to continue, nor one whose checkpoints --resume found all damaged: a new run
    replaces it."""
    ckpt, summary = latest_checkpoint(run_dir), read_json(run_dir / "summary.json")
    collapse = (f"it collapsed at step {summary.get('collapse_step')} ({summary.get('reason')})"
                if summary.get("collapsed") else None)
    if resume:
        if collapse:
            raise RunError(f"--resume: {run_dir} is kept as it ended: {collapse}; start a new run with another --name")
        if ckpt is None:
            raise nothing_to_resume(run_dir)
    elif ckpt or summary:
        saved = read_json(run_dir / "config.json")
        if not saved:
            raise RunError(f"{run_dir} holds a run without config.json: pass --name for a new run")
        ran = as_ran(saved, presets)
        differ = [f"{k} {c[k]!r} (the run: {ran.get(k)!r})" for k in ARM if c[k] != ran.get(k)]
        afresh = f"or delete {run_dir} to start it afresh"
        finished = summary and ckpt and is_finished(c, int(ckpt.stem.split("_")[1]), summary.get("minutes", 0))
        advice = (f"this command differs in {', '.join(differ)}: give it another --name (--resume would refuse), "
                  f"{afresh}" if differ else f"{collapse}: give a new run another --name, {afresh}" if collapse else
                  f"{done(summary.get('steps', 0))}: --resume with a larger --steps trains it further, --name "
                  f"starts a new run, {afresh}"
                  if finished else f"pass --resume to continue it, --name for a new run, {afresh}")
        raise RunError(f"{run_dir} exists, a run of {describe(ran, presets)}: {advice}")
    else:
        attempt = [run_dir / name for name in ("config.json", "log.csv", "ckpt") if (run_dir / name).exists()]
        if attempt:
            print(f"{run_dir}: replacing an attempt that stopped before its first checkpoint (no checkpoint, "
                  f"no summary.json)")
        for path in attempt:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def is_finished(c, step, minutes):
    """Whether a run at `step`, after `minutes` of training, has reached its --steps or --minutes (settings c):
    resuming it would train no step."""
    return step >= c["steps"] or (c["minutes"] is not None and minutes >= c["minutes"])


def done(steps):
    """What a finished run's folder says of it."""
    return f"it is finished: no collapse in {steps:,} steps (summary.json)"


def nothing_to_resume(run_dir):
    """--resume's refusal of a run with no checkpoint to continue from, and how to start it afresh: in its folder
    (an attempt is replaced), or, beside a summary.json (a result, never replaced), under another --name."""
    ckpt_dir = run_dir / "ckpt"
    why = (f"no good checkpoint in {ckpt_dir} (the damaged ones are in {ckpt_dir / DAMAGED})"
           if (ckpt_dir / DAMAGED).exists() else f"no checkpoint in {ckpt_dir} (the run stopped before its first)")
    afresh = ("start it afresh under another --name" if (run_dir / "summary.json").exists()
              else "leave out --resume to start it afresh")
    return RunError(f"--resume: {why}: {afresh}")
