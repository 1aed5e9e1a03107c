"""h2o_stream.loading.corpus: books from the shipped sample, local jsonl / jsonl.gz / parquet / text / directories and
the Hub (mocked); picking one book; tokenizing them."""

import gzip
import itertools
import json
import logging
import os
from pathlib import Path

import pytest

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading import corpus_files
from h2o_stream.loading.corpus import (
    HUB_PG19,
    SAMPLE_FILE,
    SAMPLE_TITLES,
    Book,
    book_token_ids,
    describe_source,
    iter_books,
    list_books,
    read_book,
)


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def books(source) -> list[tuple[str, str]]:
    return [(b.title, b.text) for b in iter_books(source)]


def first_error(source) -> str:
    with pytest.raises(H2OStreamError) as info:
        next(iter_books(source))
    return str(info.value)


# --- local files -------------------------------------------------------------------------------------


def test_jsonl_with_pg19_columns(tmp_path):
    path = write_jsonl(
        tmp_path / "pg.jsonl",
        [
            {"short_book_title": "Moby Dick", "publication_date": 1851, "url": "u1", "text": "Call me Ishmael.\n"},
            {"short_book_title": "Dracula", "publication_date": 1897, "url": "u2", "text": "3 May. Bistritz."},
        ],
    )
    assert books(path) == [("Moby Dick", "Call me Ishmael.\n"), ("Dracula", "3 May. Bistritz.")]
    assert describe_source(path) == "pg.jsonl (local jsonl)"


def test_jsonl_title_fallbacks_and_blank_lines(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"title": "Plain title", "text": "a"}\n\n{"text": "b"}\r\n', encoding="utf-8")
    assert books(path) == [("Plain title", "a"), ("t.jsonl:3", "b")]


def test_jsonl_missing_text_names_line_and_fields(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok"}, {"short_book_title": "X", "body": "..."}])
    it = iter_books(path)
    assert next(it).text == "ok"  # the bad row is reported when iteration reaches it
    with pytest.raises(H2OStreamError, match="line 2") as info:
        next(it)
    assert "'text'" in str(info.value) and "short_book_title, body" in str(info.value)


def test_jsonl_text_not_a_string(tmp_path):
    path = write_jsonl(tmp_path / "num.jsonl", [{"text": 42}])
    message = first_error(path)
    assert "line 1" in message and "int, not a string" in message


def test_jsonl_invalid_json_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "no closing brace"\n', encoding="utf-8")
    with pytest.raises(H2OStreamError, match=r"broken\.jsonl line 2 is not valid JSON"):
        list(iter_books(path))


def test_parquet_round_trip(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(
        {
            "short_book_title": ["A", None, "C"],
            "publication_date": [1900, 1901, 1902],
            "text": ["alpha", "beta", "gamma"],
        }
    )
    path = tmp_path / "books.parquet"
    pq.write_table(table, path, row_group_size=2)  # two row groups
    assert pq.ParquetFile(path).num_row_groups == 2
    assert books(path) == [("A", "alpha"), ("books.parquet:2", "beta"), ("C", "gamma")]
    assert describe_source(path) == "books.parquet (local parquet)"


def test_parquet_without_text_column_lists_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "nocol.parquet"
    pq.write_table(pa.table({"title": ["A"], "content": ["x"]}), path)
    message = first_error(path)
    assert "no 'text' column" in message and "title, content" in message


def test_txt_is_one_book_titled_by_stem(tmp_path):
    path = tmp_path / "The Time Machine.txt"
    path.write_text("The Time Traveller (for so it will be convenient to speak of him)\n", encoding="utf-8")
    assert books(path) == [("The Time Machine", path.read_text(encoding="utf-8"))]
    other = tmp_path / "notes.rst"  # any extension that decodes as UTF-8
    other.write_text("héllo", encoding="utf-8")
    assert books(other) == [("notes", "héllo")]
    assert describe_source(path) == "The Time Machine.txt (local text)"


def test_directory_sorted_recursive(tmp_path):
    (tmp_path / "b.txt").write_text("B", encoding="utf-8")
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "z.md").write_text("AZ", encoding="utf-8")
    write_jsonl(tmp_path / "a" / "c.jsonl", [{"short_book_title": "C1", "text": "c1"}, {"text": "c2"}])
    (tmp_path / "c.txt").write_text("C", encoding="utf-8")
    (tmp_path / "a.txt").write_text("A", encoding="utf-8")  # after the folder a/: paths sort part by part
    (tmp_path / "skip.csv").write_text("x,y", encoding="utf-8")  # not a corpus extension
    (tmp_path / ".hidden.txt").write_text("hidden", encoding="utf-8")
    assert [t for t, _ in books(tmp_path)] == ["C1", "c.jsonl:2", "z", "a", "b", "c"]
    assert describe_source(tmp_path) == f"{tmp_path.name} (local directory)"


def test_directory_without_usable_files(tmp_path):
    (tmp_path / "data.csv").write_text("a,b", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    message = first_error(tmp_path)
    assert message.startswith(f"no usable files in {tmp_path}") and ".jsonl, .parquet, .txt, .md" in message


def test_missing_path():
    message = first_error("/nonexistent/corpus.jsonl")
    assert message.startswith("no such file or directory: /nonexistent/corpus.jsonl")


@pytest.mark.parametrize(
    "name, content",
    [
        ("empty.txt", b""),
        ("empty.jsonl", b""),
        ("empty.parquet", b""),
        ("blank.txt", b"  \n\t\n"),
        ("blank.jsonl", b"\n \n"),
    ],
)
def test_empty_or_whitespace_only(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert first_error(path).startswith(f"{path} is empty")


@pytest.mark.parametrize("name", ["book.txt", "book.jsonl", "book.md"])
def test_binary_file_with_nul_bytes(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b"PK\x03\x04\x00\x00\x14\x00" + bytes(range(256)))
    assert first_error(path).startswith(f"{path} is not UTF-8 text")


def test_latin1_text_is_not_utf8(tmp_path):
    path = tmp_path / "latin.txt"
    path.write_bytes("Les Misérables, par Victor Hugo".encode("latin-1"))
    assert first_error(path).startswith(f"{path} is not UTF-8 text")
    jsonl = tmp_path / "latin.jsonl"
    jsonl.write_bytes(b'{"text": "ok"}\n' + '{"text": "café"}\n'.encode("latin-1"))
    with pytest.raises(H2OStreamError, match=r"is not UTF-8 text \(line 2"):
        list(iter_books(jsonl))


def test_iter_books_is_lazy_about_errors(tmp_path):
    it = iter_books(tmp_path / "missing.txt")  # a generator: nothing happens until next()
    with pytest.raises(H2OStreamError):
        next(it)


# --- the shipped sample ----------------------------------------------------------------------------


def test_sample_first_two_books_lazily(monkeypatch):
    opened = []

    def recording_open(*args, **kwargs):
        f = open(*args, **kwargs)  # noqa: SIM115 - handed to the code under test, which must close it (checked below)
        opened.append(f)
        return f

    monkeypatch.setattr(corpus_files, "open", recording_open, raising=False)
    it = iter_books("sample")
    two = list(itertools.islice(it, 2))
    assert [b.title for b in two] == ["Pride and Prejudice", "Frankenstein"]
    assert all(len(b.text) > 400_000 for b in two)
    # Only the first two lines (about a third of the file) have been read: the rest is never decompressed.
    assert opened and max(f.tell() for f in opened) < os.path.getsize(SAMPLE_FILE) / 2
    it.close()
    assert all(f.closed for f in opened)


def test_sample_is_small_public_domain_and_described():
    assert SAMPLE_FILE.is_file() and SAMPLE_FILE.stat().st_size < 3_000_000
    assert (SAMPLE_FILE.parent / "README.md").is_file()
    with gzip.open(SAMPLE_FILE, "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines]
    assert tuple(r["short_book_title"] for r in rows) == SAMPLE_TITLES
    assert all(r["publication_date"] < 1919 and r["url"].startswith("https://www.gutenberg.org/ebooks/") for r in rows)
    assert sum(len(r["text"]) for r in rows) > 3_000_000  # ~4 characters a token: well over 500k tokens
    described = describe_source("sample")
    assert described.startswith("sample: 5 Gutenberg books shipped with h2o-stream ")
    assert "Moby Dick; or, The Whale" in described
    assert read_book("sample", "moby dick")[0] == 2


@pytest.mark.slow
def test_sample_has_500k_tokens_of_the_default_tokenizer():
    from h2o_stream.loading.models import load_model

    tokenizer = load_model(None).tokenizer
    counts = [len(book_token_ids(book, tokenizer)) for book in iter_books("sample")]
    assert sum(counts) == 793_928  # the figure in sample/README.md


def test_jsonl_gz_is_read_like_jsonl_also_in_directories(tmp_path):
    rows = [{"short_book_title": "Emma", "text": "Emma Woodhouse."}, {"text": "untitled"}]
    with gzip.open(tmp_path / "books.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    with gzip.open(tmp_path / "note.txt.gz", "wt", encoding="utf-8") as f:
        f.write("A note.")
    assert books(tmp_path / "books.jsonl.gz") == [("Emma", "Emma Woodhouse."), ("books.jsonl.gz:2", "untitled")]
    assert books(tmp_path / "note.txt.gz") == [("note", "A note.")]
    assert [t for t, _ in books(tmp_path)] == ["Emma", "books.jsonl.gz:2", "note"]
    assert describe_source(tmp_path / "books.jsonl.gz") == "books.jsonl.gz (local jsonl, gzip)"


def test_damaged_gzip_gives_one_clear_error(tmp_path):
    path = tmp_path / "cut.jsonl.gz"
    rows = "".join(json.dumps({"text": str(i * 7919 % 10007)}) + "\n" for i in range(5000)).encode()
    path.write_bytes(gzip.compress(rows)[:2000])  # cut short
    with pytest.raises(H2OStreamError, match=r"could not read .*cut\.jsonl\.gz .*complete gzip file"):
        list(iter_books(path))
    not_gzip = tmp_path / "plain.jsonl.gz"
    not_gzip.write_text('{"text": "a"}\n', encoding="utf-8")
    assert "complete gzip file" in first_error(not_gzip)


# --- one book of a corpus ----------------------------------------------------------------------------

BOOKS = [
    {"short_book_title": "Moby Dick", "text": "Call me Ishmael."},
    {"short_book_title": "Emma", "text": "E."},
    {"short_book_title": "Emma Returns", "text": "Again."},
]


def test_read_book_by_index_or_title(tmp_path):
    path = write_jsonl(tmp_path / "b.jsonl", BOOKS)
    assert read_book(path, 1) == (1, Book("Emma", "E.")) == read_book(path, "1")
    assert read_book(path, "emma")[1].title == "Emma"  # an exact title wins over a partial match
    assert read_book(path, "RETURNS")[1].title == "Emma Returns"
    assert list_books(path) == [(0, "Moby Dick"), (1, "Emma"), (2, "Emma Returns")]
    single = tmp_path / "one.txt"
    single.write_text("Only book.", encoding="utf-8")
    assert read_book(single) == (0, Book("one", "Only book."))


@pytest.mark.parametrize(
    "book, message",
    [
        (None, r"holds 3 books: choose one by index or title .*0: 'Moby Dick', 1: 'Emma'"),
        ("Ulysses", r"no book 'Ulysses' in .*b\.jsonl \(3 books, indices 0-2\)"),
        (3, r"no book 3 in"),
        (-1, r"no book -1 in"),
        ("mm", r"book 'mm' matches 2 titles \('Emma', 'Emma Returns'\): be more specific"),
    ],
)
def test_read_book_refuses_an_unclear_choice(tmp_path, book, message):
    path = write_jsonl(tmp_path / "b.jsonl", BOOKS)
    with pytest.raises(H2OStreamError, match=message):
        read_book(path, book)


def test_read_book_refuses_an_empty_book(tmp_path):
    path = write_jsonl(
        tmp_path / "z.jsonl", [{"short_book_title": "Z", "text": "  "}, {"short_book_title": "A", "text": "a book"}]
    )
    with pytest.raises(H2OStreamError, match=r"book 0 \('Z'\) of .*z\.jsonl is empty"):
        read_book(path, "Z")


# --- the Hub (the datasets.load_dataset boundary, mocked) --------------------------------------------


@pytest.fixture
def hub_reachable(monkeypatch):
    """These tests mock the datasets boundary: pretend the connectivity probe found the Hub (it is tested in
    test_ppl_options.py), whatever this machine's network."""
    from h2o_stream.loading import sources

    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)


def test_hub_unreachable_says_to_pass_data(monkeypatch, hub_reachable):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'emozilla/pg19-test' on the Hub (LocalEntryNotFoundError)\nmore")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    message = first_error(None)
    assert message.startswith("could not load PG-19 from the Hugging Face Hub (Couldn't reach")
    assert "--data PATH" in message and "\n" not in message


def test_hub_first_row_failure_says_to_pass_data(monkeypatch, hub_reachable):
    import datasets

    class FailsOnIteration:
        def __iter__(self):
            raise OSError("offline mode is enabled")

    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: FailsOnIteration())
    message = first_error(None)
    assert "offline mode is enabled" in message and "--data PATH" in message


def test_hub_yields_books_in_order(monkeypatch, hub_reachable):
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))

        def rows():
            yield {"short_book_title": "The Iliad", "publication_date": 1900, "url": "u", "text": "Sing, O goddess"}
            yield {"short_book_title": "Emma", "publication_date": 1815, "url": "u", "text": "Emma Woodhouse"}
            raise ConnectionError("connection reset")

        return rows()

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    it = iter_books(None)
    assert list(itertools.islice(it, 2)) == [Book("The Iliad", "Sing, O goddess"), Book("Emma", "Emma Woodhouse")]
    assert calls == [((HUB_PG19,), {"split": "test", "streaming": True})]
    with pytest.raises(H2OStreamError, match="after 2 PG-19 books .*connection reset.*--data"):
        next(it)
    assert describe_source(None) == "emozilla/pg19-test (Hugging Face Hub, streaming)"


# --- tokenizing --------------------------------------------------------------------------------------


def tiny_tokenizer_with_bos(model_max_length=4):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "[UNK]": 1, "call": 2, "me": 3, "ishmael": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", unk_token="[UNK]", model_max_length=model_max_length
    )


def test_book_token_ids_adds_bos_without_truncation_or_length_warning():
    tokenizer = tiny_tokenizer_with_bos(model_max_length=4)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        ids = book_token_ids(Book("Moby Dick", "call me ishmael call me whale"), tokenizer)
    finally:
        logger.removeHandler(handler)
    assert ids == [0, 2, 3, 4, 2, 3, 1]  # BOS first, all 6 words although model_max_length is 4
    assert all(type(i) is int for i in ids)
    assert not [r for r in records if "longer than" in r.getMessage()]


def test_a_damaged_parquet_data_page_is_one_clear_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "books.parquet"
    pq.write_table(pa.table({"text": ["alpha " * 2000, "beta " * 2000]}), path, compression="snappy")
    data = bytearray(path.read_bytes())
    for i in range(40, 200):  # inside the first data page; the footer (schema, row counts) stays readable
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    with pytest.raises(H2OStreamError, match=r"books.parquet is damaged: row group 0 \(after row 0\) cannot be read"):
        list(iter_books(path))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_books_of_only_whitespace_are_refused_as_a_text_file_is(tmp_path, suffix):
    import pyarrow as pa
    import pyarrow.parquet as pq

    def corpus(name, texts):
        path = tmp_path / f"{name}{suffix}"
        if suffix == ".parquet":
            pq.write_table(pa.table({"text": texts}), path)
        else:
            path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
        return path

    blank = corpus("blank", [" \n\t ", "   "])
    with pytest.raises(H2OStreamError, match=r"blank\S* is empty \(its 2 book\(s\) hold only whitespace\)"):
        next(iter_books(blank))  # before anything is read from it
    # a blank book among books with text is read in its place (a corpus may hold one); only an all-blank file is
    mixed = corpus("mixed", ["  ", "a real book", " "])
    assert [book.text for book in iter_books(mixed)] == ["  ", "a real book", " "]
