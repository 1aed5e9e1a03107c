"""apps/summarize/documents.py: what summarize reads (text, or one book of a corpus through the one corpus reader)
and the clear error for every bad input."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from h2o_stream import H2OStreamError
from h2o_stream.apps.summarize import as_document, encode, list_books, load_document, summarize
from support.summarize_helpers import BOOKS, TRAINING_TEXTS, jsonl, run  # noqa: F401  (TRAINING_TEXTS: conftest)

torch.set_num_threads(1)


def test_files_txt_md_and_jsonl_rows_by_index_or_title(tmp_path, model, tokenizer):
    (tmp_path / "a.txt").write_text("Plain text.", encoding="utf-8")
    (tmp_path / "b.md").write_text("\ufeff# Title\n\nMarkdown.", encoding="utf-8")
    books = jsonl(tmp_path / "books.jsonl", BOOKS)
    assert load_document(tmp_path / "a.txt").text == "Plain text."
    assert load_document(str(tmp_path / "b.md")).text.startswith("# Title")  # BOM dropped
    assert load_document(books, book=1).title == "Emma"
    assert load_document(books, book="1").title == "Emma"
    assert load_document(books, book="emma").title == "Emma"  # exact title wins over a partial match
    assert load_document(books, book="moby").title == "Moby Dick"
    assert list_books(books) == [(0, "Moby Dick"), (1, "Emma"), (2, "Emma Returns")]
    result, _ = run(model, tokenizer, str(books), book="Moby Dick")
    assert result.title == "Moby Dick" and result.tokens_read == len(encode(tokenizer, BOOKS[0]["text"]))
    result, _ = run(model, tokenizer, tmp_path / "a.txt")
    assert result.source == str(tmp_path / "a.txt") and result.tokens_read == len(encode(tokenizer, "Plain text."))


@pytest.mark.parametrize(
    "setup, call, message",
    [
        (None, lambda p: load_document(p / "missing.txt"), r"no such file or directory: .*missing\.txt"),
        (None, lambda p: summarize(str(p / "missing.md"), None), r"no such file or directory: .*missing\.md"),
        (lambda p: (p / "e.txt").write_text(""), lambda p: load_document(p / "e.txt"), r"e\.txt is empty"),
        (lambda p: (p / "w.txt").write_text(" \n\t\n"), lambda p: load_document(p / "w.txt"), r"w\.txt is empty"),
        (
            lambda p: (p / "x.bin").write_bytes(b"GGUF\x00\x01\x02"),
            lambda p: load_document(p / "x.bin"),
            r"x\.bin is not UTF-8 text: it looks like a binary file \(it contains NUL bytes\)",
        ),
        (
            lambda p: (p / "l.txt").write_bytes("caf\u00e9".encode("latin-1")),
            lambda p: load_document(p / "l.txt"),
            r"l\.txt is not UTF-8 text \(byte 0xe9 at offset 3\)",
        ),
        (None, lambda p: load_document(p), r"no usable files in"),  # a directory is a corpus; this one is empty
        (
            lambda p: jsonl(p / "b.jsonl", BOOKS),
            lambda p: load_document(p / "b.jsonl"),
            r"holds 3 books: choose one by index or title .*0: 'Moby Dick', 1: 'Emma'",
        ),
        (
            lambda p: jsonl(p / "b.jsonl", BOOKS),
            lambda p: load_document(p / "b.jsonl", book="Ulysses"),
            r"no book 'Ulysses' in .*3 books, indices 0-2.*'Moby Dick'",
        ),
        (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl", book=7), r"no book 7"),
        (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl", book="mm"), r"matches 2 titles"),
        (
            lambda p: (p / "bad.jsonl").write_text('{"text": "a"}\nnot json\n'),
            lambda p: load_document(p / "bad.jsonl"),
            r"line 2 is not valid JSON",
        ),
        (
            lambda p: jsonl(p / "n.jsonl", [{"title": "x"}]),
            lambda p: load_document(p / "n.jsonl"),
            r"line 1 has no 'text' field",
        ),
        (
            lambda p: jsonl(p / "z.jsonl", [{"short_book_title": "Z", "text": "  "}, {"text": "a"}]),
            lambda p: load_document(p / "z.jsonl", book="Z"),
            r"book 0 \('Z'\) of .* is empty",
        ),
        (
            lambda p: (p / "a.txt").write_text("x"),
            lambda p: load_document(p / "a.txt", book=1),
            r"no book 1 in .*a\.txt \(1 book, index 0\): e\.g\. 0: 'a'",
        ),
        (None, lambda p: as_document("Some text to summarize.", book=1), r"book= only applies to a corpus"),
        (None, lambda p: load_document("sample"), r"sample holds 5 books: choose one .*0: 'Pride and Prejudice'"),
    ],
    ids=[
        "missing",
        "missing-via-summarize",
        "empty",
        "whitespace",
        "binary",
        "not-utf8",
        "directory",
        "jsonl-needs-book",
        "jsonl-unknown-title",
        "jsonl-bad-index",
        "jsonl-ambiguous",
        "jsonl-bad-json",
        "jsonl-no-text",
        "jsonl-empty-row",
        "book-for-txt",
        "book-for-text",
        "sample-needs-book",
    ],
)
def test_bad_files_give_one_clear_error(tmp_path, setup, call, message):
    if setup is not None:
        setup(tmp_path)
    with pytest.raises(H2OStreamError, match=message) as info:
        call(tmp_path)
    assert "\n" not in str(info.value)


def test_the_shipped_sample_and_directories_are_corpora_too(tmp_path):
    moby = load_document("sample", book="Moby Dick")
    assert moby.title == "Moby Dick; or, The Whale" and moby.source == "sample#2"
    assert moby.text.lstrip().startswith("Produced by") and len(moby.text) > 1_000_000
    assert as_document("sample", book=4).title == "The Time Machine"
    (tmp_path / "a.txt").write_text("First.", encoding="utf-8")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"short_book_title": "Emma", "text": "Emma Woodhouse."}) + "\n")
    assert load_document(tmp_path, book="emma").source == f"{tmp_path}#1"
    assert load_document(tmp_path / "b.jsonl.gz").text == "Emma Woodhouse."
