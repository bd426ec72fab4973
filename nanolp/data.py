"""
Character-level data. A UTF-8 text file becomes one token per character (the vocabulary is the sorted set
of characters in the file), split 90/10 into train and validation, and cached as uint16 token files under
data/<name>/. Batches are sampled on the device, from a generator seeded by (seed, step) alone.
"""

import hashlib
import http.client
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
DEFAULT_SHA1 = "04486597058d11dcc2c556b1d0433891eb639d2e"   # TinyShakespeare's (data/README.md)

HOW_TO_GIVE_TEXT = (
    "Copy TinyShakespeare's input.txt to {default} (the default run, under its own name), "
    "or train on any UTF-8 text file: python train.py --data PATH, or the environment variable NANOLP_DATA=PATH."
)


@dataclass
class Dataset:
    train: torch.Tensor  # uint16 token ids, the first 90% of the text
    val: torch.Tensor    # uint16 token ids, the last 10%
    itos: str            # itos[i] is the character of token i
    sha1: str            # the text's, of the very bytes tokenized

    @property
    def vocab_size(self):
        return len(self.itos)


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
        except (OSError, http.client.HTTPException) as e:  # URLError, timeouts; a body cut short (IncompleteRead)
            raise TextError(
                f"no text at {DEFAULT_TEXT} and the download from {DEFAULT_URL} failed "
                f"({getattr(e, 'reason', e)}). " + HOW_TO_GIVE_TEXT.format(default=DEFAULT_TEXT)) from None
        if (got := hashlib.sha1(text).hexdigest()) != DEFAULT_SHA1:   # (a proxy's login page, a changed file)
            raise TextError(f"no text at {DEFAULT_TEXT} and what {DEFAULT_URL} sent is not TinyShakespeare "
                            f"({len(text):,} bytes, sha1 {got}, not {DEFAULT_SHA1}). "
                            + HOW_TO_GIVE_TEXT.format(default=DEFAULT_TEXT))
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
    text = Path(text).resolve()   # (a relative input.txt is named by the folder it is in too)
    return text.parent.name if text.stem == "input" else text.stem


def prepare(path=None, data_dir=None, block_size=None):
    """Tokenize the text (or reuse the cached tokens of the very same text) and return a Dataset. With block_size,
    each split must hold at least one example (block_size + 1 tokens: a block and its next-token targets)."""
    text_path = find_text(path)
    try:
        raw = text_path.read_bytes()
    except OSError as e:   # (no permission to read it)
        raise TextError(f"{text_path} cannot be read ({e.strerror}): give a text this user can read") from None
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
    files = [cache / f"{split}.bin" for split in ("train", "val")]
    cached = read_cache(meta_path, files)
    if cached is not None and cached[0] == key:
        _, itos, train, val = cached
    else:
        if b"\0" in raw:   # (valid UTF-8, but no text: a UTF-16 file, or a binary one)
            raise TextError(f"{text_path} holds NUL bytes (byte {raw.index(0)}): not a UTF-8 text (convert a UTF-16 "
                            "file with iconv -f utf-16 -t utf-8)")
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
        try:
            write_cache(meta_path, files, dict(sha1=key, source=str(text_path), itos=itos), train, val)
        except OSError as e:
            raise TextError(f"cannot write {text_path}'s token cache at {cache} ({e.strerror or e}): make room for it, "
                            f"or move what is at {e.filename or cache} away") from None
    for split, tokens in (("training", train), ("validation", val)):
        if block_size is not None and len(tokens) < block_size + 1:
            need = next(n for n in itertools.count(block_size + 1)
                        if min(split_point(n), n - split_point(n)) >= block_size + 1)
            raise TextError(f"{text_path} is too short: {len(train) + len(val)} characters, so its {split} split "
                            f"has {len(tokens)}, and one example takes block_size + 1 = {block_size + 1}; give a "
                            f"text of at least {need} characters, or a smaller --block-size")
    return Dataset(torch.from_numpy(train), torch.from_numpy(val), itos, key)


def read_cache(meta_path, files):
    """(the text's sha1, itos, train, val) from a token cache that holds them whole, else None (none yet, or a
    meta.json or token file cut short, damaged or left by another text's write: the cache is made again). meta.json
    records the token files' sha1, so whatever they hold, they are read only as the tokens meta.json describes."""
    try:
        meta = json.loads(meta_path.read_text())
        raw = [file.read_bytes() for file in files]
    except (OSError, ValueError):
        return None
    fields = dict(sha1=str, itos=str, tokens_sha1=str)
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), kind) for k, kind in fields.items()):
        return None
    if hashlib.sha1(b"".join(raw)).hexdigest() != meta["tokens_sha1"]:   # (as write_cache wrote them, or not)
        return None
    train, val = (np.frombuffer(r, dtype=np.uint16).copy() for r in raw)
    return meta["sha1"], meta["itos"], train, val


def write_cache(meta_path, files, meta, train, val):
    """Write a token cache: each file under a name of its own, then renamed (no reader sees it half written), and
    meta.json last, with the token files' sha1 (read_cache takes no other files for them)."""
    meta_path.parent.mkdir(parents=True, exist_ok=True)
    for file, tokens in zip(files, (train, val)):
        part = file.with_name(f"{file.name}.{os.getpid()}.part")
        tokens.tofile(part)
        os.replace(part, file)
    tokens_sha1 = hashlib.sha1(train.tobytes() + val.tobytes()).hexdigest()
    part = meta_path.with_name(f"{meta_path.name}.{os.getpid()}.part")
    part.write_text(json.dumps({**meta, "tokens": [len(train), len(val)], "tokens_sha1": tokens_sha1}))
    os.replace(part, meta_path)


def get_batch(tokens, batch_size, block_size, seed, step):
    """Batch number `step` of a run with this seed, sampled where `tokens` lives (an integer tensor).
    It is a pure function of (seed, step), so a resumed run sees exactly the batches an uninterrupted one would."""
    g = torch.Generator(device=tokens.device).manual_seed(seed * 1_000_003 + step)
    start = torch.randint(len(tokens) - block_size, (batch_size,), generator=g, device=tokens.device)
    chunk = tokens[start[:, None] + torch.arange(block_size + 1, device=tokens.device)]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
