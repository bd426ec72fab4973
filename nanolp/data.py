"""
Character-level data. A UTF-8 text file becomes one token per character (the vocabulary is the sorted set
of characters in the file), split 90/10 into train and validation, and cached as uint16 token files under
data/<name>/. Batches are sampled on the device, from a generator seeded by (seed, step) alone.
"""

import hashlib
import itertools
import json
import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = ROOT / "data"
DEFAULT_TEXT = DATA_DIR / "tinyshakespeare" / "input.txt"
# the seed of the probe's fixed training batches (train.py): runs take the seeds below it, so none of fewer than
# 1,000,003 steps draws them as its own (get_batch's generator is seeded seed * 1,000,003 + step)
PROBE_SEED = 10**6
DEFAULT_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"

HOW_TO_GIVE_TEXT = (
    "Copy TinyShakespeare's input.txt to {default} (the default run, under its own name), "
    "or train on any UTF-8 text file: python train.py --data PATH, or the environment variable NANOLP_DATA=PATH."
)


@dataclass
class Dataset:
    train: torch.Tensor  # uint16 token ids, the first 90% of the text
    val: torch.Tensor    # uint16 token ids, the last 10%
    itos: str            # itos[i] is the character of token i

    @property
    def vocab_size(self):
        return len(self.itos)

    @property
    def stoi(self):
        return {ch: i for i, ch in enumerate(self.itos)}

    def encode(self, text):
        stoi = self.stoi
        return [stoi[ch] for ch in text]

    def decode(self, ids):
        return "".join(self.itos[i] for i in ids)


class TextError(ValueError):
    """A text that cannot be trained on (missing, unreadable as UTF-8, too short), or none to download: the
    message says which file and what to do, in one line (train.py prints it as it is)."""


def text_path(path):
    """A text's path as find_text reads it: a relative path that is not in the current directory but is in the
    repository is the repository's file (a preset's text, from any directory)."""
    if not Path(path).is_absolute() and not Path(path).exists() and (ROOT / path).is_file():
        return ROOT / path
    return Path(path)


def find_text(path=None):
    """The text to train on: an explicit path, else $NANOLP_DATA, else the local TinyShakespeare,
    which is downloaded on first use. A relative path that is not in the current directory but is in the
    repository is the repository's file (a preset's text, from any directory)."""
    path = path or os.environ.get("NANOLP_DATA")
    if path:
        path = text_path(path)
        if not Path(path).is_file():   # (a folder or a device is no text file)
            why = "it is not a regular file" if Path(path).exists() else "that file does not exist"
            raise TextError(f"no text file at {path}: {why} (data/README.md says how to get each text; give an "
                            f"existing one with --data PATH or NANOLP_DATA=PATH, or neither for TinyShakespeare)")
        return Path(path)
    if not DEFAULT_TEXT.is_file():
        print(f"downloading TinyShakespeare from {DEFAULT_URL}")
        try:
            with urllib.request.urlopen(DEFAULT_URL, timeout=30) as response:
                text = response.read()
        except OSError as e:  # URLError and timeouts are OSErrors
            raise TextError(
                f"no text at {DEFAULT_TEXT} and the download from {DEFAULT_URL} failed "
                f"({getattr(e, 'reason', e)}). " + HOW_TO_GIVE_TEXT.format(default=DEFAULT_TEXT)) from e
        DEFAULT_TEXT.parent.mkdir(parents=True, exist_ok=True)
        partial = DEFAULT_TEXT.with_suffix(".part")  # rename at the end, so a broken download never looks done
        partial.write_bytes(text)
        partial.rename(DEFAULT_TEXT)
    return DEFAULT_TEXT


def split_point(n):
    """How many of a text's n tokens train (the first 90%); the rest validate."""
    return int(0.9 * n)


def cache_name(text):
    """The name of a text's token cache, and of the text in a run's name: char-rnn data sets come as
    <name>/input.txt; any other file is named by itself, less its extension."""
    text = Path(text)
    return text.parent.name if text.stem == "input" else text.stem


def prepare(path=None, data_dir=None, block_size=None):
    """Tokenize the text (or reuse the cached tokens of the very same text) and return a Dataset. With block_size,
    each split must hold at least one example (block_size + 1 tokens: a block and its next-token targets)."""
    text_path = find_text(path)
    raw = text_path.read_bytes()
    if not raw:   # (TinyShakespeare's place emptied: copy it back; a text given: give another)
        raise TextError(f"{text_path} is empty. " + (HOW_TO_GIVE_TEXT.format(default=DEFAULT_TEXT)
                        if text_path == DEFAULT_TEXT else "Give a text with something in it (--data PATH or "
                                                          "NANOLP_DATA=PATH), or neither for TinyShakespeare."))
    key = hashlib.sha1(raw).hexdigest()  # the cache follows the text's content, not its name or date
    cache = Path(data_dir or DATA_DIR) / cache_name(text_path)
    if cache.resolve() == text_path.resolve():
        raise TextError(f"{text_path} would share its path with its token cache (a text without an extension in "
                        f"{cache.parent}): rename it, as {text_path.name}.txt, or move it elsewhere")
    meta_path = cache / "meta.json"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):   # none yet, or cut short as it was written: the cache is made again
        meta = {}
    # the cache is used if it holds this text's tokens whole: each token file as long as meta.json recorded (one
    # cut short, or a cache written before meta.json recorded the lengths, is made again)
    files = [cache / f"{split}.bin" for split in ("train", "val")]
    sizes = [file.stat().st_size if file.is_file() else None for file in files]
    if meta.get("sha1") == key and sizes == [2 * n for n in meta.get("tokens", [])]:   # (2 bytes a uint16 token)
        itos = meta["itos"]
        train, val = (np.fromfile(file, dtype=np.uint16) for file in files)
    else:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(f"{text_path} is not UTF-8 (byte {e.start}, 0x{raw[e.start]:02x}: {e.reason}); "
                            "convert it to UTF-8 (e.g. iconv -f latin1 -t utf-8 for a Latin-1 text)") from None
        codepoints = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
        chars = np.flatnonzero(np.bincount(codepoints))   # the distinct characters, sorted (a count, not a sort)
        if len(chars) > 2**16:
            raise TextError(f"{text_path} has {len(chars)} distinct characters; uint16 tokens hold at most 65536")
        itos = "".join(map(chr, chars))
        token = np.zeros(chars[-1] + 1, dtype=np.uint16)   # code point -> token id (the text is not empty)
        token[chars] = np.arange(len(chars))
        ids = token[codepoints]
        n = split_point(len(ids))
        train, val = ids[:n], ids[n:]
        cache.mkdir(parents=True, exist_ok=True)
        train.tofile(files[0])
        val.tofile(files[1])
        meta_path.write_text(json.dumps({"sha1": key, "source": str(text_path), "itos": itos,  # meta last
                                         "tokens": [len(train), len(val)]}))
    for split, tokens in (("training", train), ("validation", val)):
        if block_size is not None and len(tokens) < block_size + 1:
            need = next(n for n in itertools.count(block_size + 1)
                        if min(split_point(n), n - split_point(n)) >= block_size + 1)
            raise TextError(f"{text_path} is too short: {len(train) + len(val)} characters, so its {split} split "
                            f"has {len(tokens)}, and one example takes block_size + 1 = {block_size + 1}; give a "
                            f"text of at least {need} characters, or a smaller --block-size")
    return Dataset(torch.from_numpy(train), torch.from_numpy(val), itos)


def get_batch(tokens, batch_size, block_size, seed, step):
    """Batch number `step` of a run with this seed, sampled where `tokens` lives (an integer tensor).
    It is a pure function of (seed, step), so a resumed run sees exactly the batches an uninterrupted one would."""
    g = torch.Generator(device=tokens.device).manual_seed(seed * 1_000_003 + step)
    start = torch.randint(len(tokens) - block_size, (batch_size,), generator=g, device=tokens.device)
    chunk = tokens[start[:, None] + torch.arange(block_size + 1, device=tokens.device)]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
