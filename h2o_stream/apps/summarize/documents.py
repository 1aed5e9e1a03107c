"""What summarize reads: the text itself, or one book of a corpus (a text file, a PG-19 .jsonl, the shipped sample,
...) read through `h2o_stream.loading.corpus`, the reader every command shares."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.corpus import SAMPLE, list_books, read_book

#: a one-line string ending like this is taken for a file name (a missing file is reported, not summarized)
PATH_LIKE_SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst", ".jsonl", ".json", ".gz", ".parquet", ".pdf")

__all__ = ["Document", "as_document", "list_books", "load_document", "text_from_bytes"]


@dataclass
class Document:
    """A document to summarize."""

    text: str
    title: str | None = None
    source: str | None = None  # where it came from: a file, "FILE#INDEX" for one book of several; None for text


def load_document(source: str | os.PathLike, *, book: int | str | None = None) -> Document:
    """One book of `source` ("sample", a UTF-8 text file, a PG-19 .jsonl/.jsonl.gz/.parquet, a directory): the only
    one, or the one `book` names by index or (part of its) title."""
    index, chosen = read_book(source, book)
    name = os.fspath(source)
    path = None if name == SAMPLE else Path(name).expanduser()
    # A lone text file is its own document; one book of several is named by its index.
    whole = path is not None and path.is_file() and not path.name.lower().endswith((".jsonl", ".jsonl.gz", ".parquet"))
    return Document(text=chosen.text, title=chosen.title, source=str(path) if whole else f"{path or name}#{index}")


def as_document(text_or_path, *, book=None) -> Document:
    """A Document, a Path, an existing file name or the name "sample" is read as a corpus; a one-line string that
    ends like a file name is taken for a missing file; any other string is the document's text."""
    if isinstance(text_or_path, Document):
        require_text(text_or_path.text, "the document")
        return text_or_path
    if isinstance(text_or_path, os.PathLike):
        return load_document(text_or_path, book=book)
    if not isinstance(text_or_path, str):
        raise H2OStreamError(f"expected the document's text or a file path, got {type(text_or_path).__name__}")
    name = text_or_path.strip()
    looks_like_path = (
        "\n" not in text_or_path
        and len(text_or_path) < 4096
        and (name == SAMPLE or _is_file(name) or name.lower().endswith(PATH_LIKE_SUFFIXES))
    )
    if looks_like_path:
        return load_document(name, book=book)
    if book is not None:
        raise H2OStreamError("book= only applies to a corpus (a file, a directory or 'sample'), not to text")
    require_text(text_or_path, "the document")
    return Document(text=text_or_path)


def require_text(text: str, label: str) -> None:
    """An error if `text` is blank, or not valid text (lone surrogates: bytes that were not UTF-8, decoded with
    surrogateescape, on which the tokenizer fails)."""
    if not text.strip():
        raise H2OStreamError(f"{label} is empty: there is nothing to summarize")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise H2OStreamError(
            f"{label} is not valid text (character {error.start} is not UTF-8: {text[error.start]!r})"
        ) from None


def text_from_bytes(data: bytes, label: str) -> str:
    """`data` as UTF-8 text (a leading BOM dropped); one clear error naming `label` for binary data or another
    encoding. (The corpus reader makes the same checks for files.)"""
    if b"\0" in data:
        raise H2OStreamError(f"{label} is not UTF-8 text: it looks like binary data (it contains NUL bytes)")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        raise H2OStreamError(
            f"{label} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}); "
            "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8"
        ) from None
    require_text(text, label)
    return text


def _is_file(name: str) -> bool:
    try:
        return Path(name).expanduser().is_file()
    except (OSError, ValueError):
        return False
