"""nanolp/data.py: tokenizing, the token cache, a clear error for every text that cannot be trained on, batches as a
function of (seed, step)."""
import hashlib
import http.client
import io
import json
import re
from pathlib import Path

import pytest
import torch

from nanolp import data


def decode(ds, tokens):
    """The text of token ids, as the vocabulary maps them."""
    return "".join(ds.itos[i] for i in tokens.tolist())


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("to be, or not to be: that is the question. " * 50 + "naïve café ☃ 😀\n",
                    encoding="utf-8")   # (😀 past 16 bits)
    return path


def test_prepare_round_trip(text_file, tmp_path):
    ds = data.prepare(text_file, data_dir=tmp_path / "cache")
    text = text_file.read_text(encoding="utf-8")
    assert ds.itos == "".join(sorted(set(text)))  # any UTF-8 text: one token per character
    assert ds.train.dtype == ds.val.dtype == torch.uint16
    assert len(ds.train) == int(0.9 * len(text)) and len(ds.train) + len(ds.val) == len(text)
    assert decode(ds, torch.cat([ds.train, ds.val])) == text
    assert ds.sha1 == hashlib.sha1(text_file.read_bytes()).hexdigest()   # (a run records it: data_sha1)
    assert (tmp_path / "cache" / "tiny" / "train.bin").is_file()


def test_cache_reused_and_invalidated(text_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = data.prepare(text_file, data_dir=cache)
    # the second call must read the token files, not tokenize again (nor write them)
    written = [(file, file.stat().st_mtime_ns) for file in (cache / "tiny").iterdir()]
    monkeypatch.setattr(data.np, "bincount", lambda *a, **k: pytest.fail("tokenized again"))
    again = data.prepare(text_file, data_dir=cache)
    assert torch.equal(first.train, again.train) and first.itos == again.itos and first.sha1 == again.sha1
    assert [(file, file.stat().st_mtime_ns) for file in (cache / "tiny").iterdir()] == written
    monkeypatch.undo()
    text_file.write_text("a different text, same file name\n" * 20, encoding="utf-8")
    changed = data.prepare(text_file, data_dir=cache)
    assert decode(changed, changed.train) != decode(first, first.train)
    assert "?" not in changed.itos and "d" in changed.itos


def test_a_token_file_cut_short_is_made_again(text_file, tmp_path):
    """The cache holds the text's tokens whole or is made again: a train.bin or val.bin cut short (a full disk, a
    copy) would otherwise train on part of the text, or refuse it as too short, under the whole text's sha1."""
    cache = tmp_path / "cache"
    whole = data.prepare(text_file, data_dir=cache, block_size=64)
    for split in ("train", "val"):
        tokens = cache / "tiny" / f"{split}.bin"
        tokens.write_bytes(tokens.read_bytes()[:200])   # 100 tokens: enough for a block of 64
        again = data.prepare(text_file, data_dir=cache, block_size=64)
        assert torch.equal(again.train, whole.train) and torch.equal(again.val, whole.val), split
    (cache / "tiny" / "meta.json").write_text('{"sha1": "')   # cut short as it was written: made again too
    assert torch.equal(data.prepare(text_file, data_dir=cache).train, whole.train)
    meta = json.loads((cache / "tiny" / "meta.json").read_text())
    for damaged in ([], None, "x", {**meta, "itos": 7}, {**meta, "tokens_sha1": None}):   # JSON, not a cache's
        (cache / "tiny" / "meta.json").write_text(json.dumps(damaged))
        assert torch.equal(data.prepare(text_file, data_dir=cache).val, whole.val), damaged


def test_token_files_are_read_only_as_the_tokens_their_meta_describes(text_file, tmp_path, monkeypatch):
    """Token files of the right length but other content (damaged, or another text's of the same name and length
    written over them) are not taken for the text's; nor are those a write cut short left behind."""
    cache = tmp_path / "cache"
    whole = data.prepare(text_file, data_dir=cache)
    text = text_file.read_text(encoding="utf-8")
    train = cache / "tiny" / "train.bin"
    train.write_bytes(b"\x60\xea" * (train.stat().st_size // 2))   # token 60000, as long as before
    assert decode(data.prepare(text_file, data_dir=cache), whole.train) == text[:len(whole.train)]
    # another text of the same name and length, its write stopped before its meta.json: this text's again, whole
    other = tmp_path / "other" / "tiny.txt"
    other.parent.mkdir()
    other.write_text(text[::-1], encoding="utf-8")
    replace = data.os.replace
    def stopped(part, file):
        if Path(file).name == "meta.json":
            raise KeyboardInterrupt
        replace(part, file)
    monkeypatch.setattr(data.os, "replace", stopped)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(other, data_dir=cache)
    monkeypatch.undo()
    again = data.prepare(text_file, data_dir=cache)
    assert decode(again, torch.cat([again.train, again.val])) == text
    mixed = data.prepare(other, data_dir=cache)   # and the other text's own, after this one's
    assert decode(mixed, torch.cat([mixed.train, mixed.val])) == text[::-1]


def test_a_folder_or_a_device_is_no_text_file(tmp_path):
    for path in (tmp_path, "/dev/null"):
        with pytest.raises(data.TextError, match=f"^no text file at {path}: it is not a regular file \\(data/"):
            data.find_text(path)


def test_env_var_then_explicit_path(text_file, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOLP_DATA", str(text_file))
    assert data.find_text() == text_file
    other = tmp_path / "other.txt"
    other.write_text("xyz")
    assert data.find_text(other) == other  # the --data flag wins over the environment


def test_a_relative_path_in_the_checkout_works_from_any_directory(tmp_path, monkeypatch):
    """The corpus preset names data/corpus/input.txt: run from another folder it is still the checkout's file, while
    a file of that name in the current folder wins."""
    monkeypatch.chdir(tmp_path)
    assert data.find_text("nanolp/data.py") == data.ROOT / "nanolp" / "data.py"
    (tmp_path / "nanolp").mkdir()
    (tmp_path / "nanolp" / "data.py").write_text("xyz")
    assert data.find_text("nanolp/data.py") == Path("nanolp/data.py")


def test_a_relative_input_txt_is_named_by_its_folder(tmp_path, monkeypatch):
    """char-rnn's <name>/input.txt, given from inside <name>/: its cache is still data/<name>/, not the data folder."""
    (tmp_path / "poems").mkdir()
    monkeypatch.chdir(tmp_path / "poems")
    assert data.cache_name("input.txt") == data.cache_name(tmp_path / "poems" / "input.txt") == "poems"


def test_a_download_that_is_not_tinyshakespeare_is_not_kept(tmp_path, monkeypatch):
    """A proxy's page sent with status 200, or a body cut short: one line, and nothing saved as TinyShakespeare."""
    monkeypatch.delenv("NANOLP_DATA", raising=False)
    monkeypatch.setattr(data, "DEFAULT_TEXT", tmp_path / "tinyshakespeare" / "input.txt")
    monkeypatch.setattr(data.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"<html>log in</html>"))
    with pytest.raises(data.TextError, match=r"^no text at \S+input.txt and what \S+ sent is not TinyShakespeare "
                                             r"\(19 bytes, sha1 [0-9a-f]{40}, not 04486597058d11dcc2c556b1d0433891eb639d2e\)"
                                             r"\. Copy TinyShakespeare's input.txt to "):
        data.find_text()
    def cut_short(url, timeout):
        raise http.client.IncompleteRead(b"First Citizen", 1113894)
    monkeypatch.setattr(data.urllib.request, "urlopen", cut_short)
    with pytest.raises(data.TextError, match=r"^no text at \S+input.txt and the download from \S+ failed \("):
        data.find_text()
    assert not (tmp_path / "tinyshakespeare").exists()


def test_missing_file_says_how_to_give_one(tmp_path, monkeypatch):
    with pytest.raises(data.TextError, match="no text file at .*missing.txt: that file does not exist .*--data PATH"
                                             ".*NANOLP_DATA") as error:
        data.prepare(tmp_path / "missing.txt", data_dir=tmp_path)
    assert "Copy TinyShakespeare" not in str(error.value)   # a path given is a file missing, not a text to put in place
    # no default file and no network (a closed local port): where to put the file, not a stack of urllib errors
    monkeypatch.delenv("NANOLP_DATA", raising=False)
    monkeypatch.setattr(data, "DEFAULT_TEXT", tmp_path / "tinyshakespeare" / "input.txt")
    monkeypatch.setattr(data, "DEFAULT_URL", "http://127.0.0.1:9/input.txt")
    with pytest.raises(data.TextError) as error:
        data.prepare(data_dir=tmp_path)
    assert re.fullmatch(r"no text at \S+/tinyshakespeare/input.txt and the download from http://127.0.0.1:9/input.txt "
                        r"failed \(.*\)\. Copy TinyShakespeare's input.txt to \S+/tinyshakespeare/input.txt "
                        r".*--data PATH.*NANOLP_DATA=PATH\.",
                        str(error.value))
    assert "\n" not in str(error.value) and not (tmp_path / "tinyshakespeare").exists()


def test_texts_that_cannot_be_trained_on(tmp_path, monkeypatch):
    """Each gets one line that names the file and says what to do."""
    def error(content, block_size=None):
        path = tmp_path / "text.txt"
        path.write_bytes(content)
        with pytest.raises(data.TextError) as raised:
            data.prepare(path, data_dir=tmp_path / "cache", block_size=block_size)
        assert str(path) in str(raised.value) and "\n" not in str(raised.value)
        return str(raised.value)

    assert error(b"").endswith("text.txt is empty. Give a text with something in it (--data PATH or "
                               "NANOLP_DATA=PATH), or neither for TinyShakespeare.")
    # TinyShakespeare's own place emptied: put it back
    monkeypatch.setattr(data, "DEFAULT_TEXT", tmp_path / "tinyshakespeare" / "input.txt")
    monkeypatch.delenv("NANOLP_DATA", raising=False)
    data.DEFAULT_TEXT.parent.mkdir()
    data.DEFAULT_TEXT.write_bytes(b"")
    with pytest.raises(data.TextError, match=r"input.txt is empty. Copy TinyShakespeare's input.txt to "):
        data.prepare(data_dir=tmp_path / "cache")
    assert error("naïve café ".encode("utf-8") + "garçon".encode("latin-1")).startswith(
        f"{tmp_path / 'text.txt'} is not UTF-8 (byte 16, 0xe7: invalid continuation byte)")   # ç: 13 bytes, then g a r
    many = "".join(chr(c) for c in range(0x20, 0x20 + 2**16 + 1 + 2048) if not 0xD800 <= c < 0xE000)   # (surrogates)
    assert "has 65537 distinct characters; uint16 tokens hold at most 65536" in error(many.encode("utf-8"))
    # a training example is block_size + 1 characters, and the validation split (the last 10%) needs one too
    assert "10 characters, so its training split has 9, and one example takes block_size + 1 = 65; give a text " \
           "of at least 641 characters, or a smaller --block-size" in error(b"0123456789", block_size=64)
    assert "640 characters, so its validation split has 64" in error(b"x" * 640, block_size=64)
    data.prepare(tmp_path / "text.txt", data_dir=tmp_path / "cache", block_size=63)   # the same text, a block less
    (tmp_path / "text.txt").write_bytes(b"x" * 641)
    ds = data.prepare(tmp_path / "text.txt", data_dir=tmp_path / "cache", block_size=64)
    assert (len(ds.train), len(ds.val)) == (576, 65)
    data.get_batch(ds.val.long(), 4, 64, seed=0, step=0)   # the shortest split still gives a batch
    def unreadable(self):
        raise PermissionError(13, "Permission denied")
    with monkeypatch.context() as denied:   # (as root every file can be read: the refusal is simulated)
        denied.setattr(Path, "read_bytes", unreadable)
        with pytest.raises(data.TextError, match=r"^\S+text.txt cannot be read \(Permission denied\): give a text "
                                                 r"this user can read$"):
            data.prepare(tmp_path / "text.txt", data_dir=tmp_path / "cache")
    # valid UTF-8 with NUL bytes: a UTF-16 file (or a binary one), not a text
    assert "holds NUL bytes (byte 1): not a UTF-8 text (convert a UTF-16 file with iconv -f utf-16 -t utf-8)" in \
        error("to be or not to be\n".encode("utf-16-le") * 50)
    (tmp_path / "cache" / "blocked").write_text("a file where the text's token cache goes")
    blocked = tmp_path / "blocked.txt"
    blocked.write_text("to be or not to be\n" * 100)
    with pytest.raises(data.TextError, match=r"^cannot write \S+blocked.txt's token cache at \S+cache/blocked \(.+\): "
                                             r"make room for it, or move what is at \S+ away$"):
        data.prepare(blocked, data_dir=tmp_path / "cache")
    bare = tmp_path / "cache" / "words"   # a text without an extension where the caches are: its cache's own path
    bare.write_text("to be or not to be\n" * 100)
    with pytest.raises(data.TextError, match=r"would share its path with its token cache .* as words\.txt"):
        data.prepare(bare, data_dir=tmp_path / "cache")


def test_batches_are_a_function_of_seed_and_step():
    tokens = torch.arange(1000)
    x, y = data.get_batch(tokens, 4, 16, seed=3, step=7)
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    data.get_batch(tokens, 4, 16, seed=3, step=8)  # whatever came before does not matter
    x2, _ = data.get_batch(tokens, 4, 16, seed=3, step=7)
    assert torch.equal(x, x2)
    assert not torch.equal(x, data.get_batch(tokens, 4, 16, seed=3, step=6)[0])
    assert not torch.equal(x, data.get_batch(tokens, 4, 16, seed=4, step=7)[0])
    assert int(data.get_batch(tokens, 256, 16, seed=0, step=0)[1].max()) <= 999  # never past the end
