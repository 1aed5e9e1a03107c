"""One local corpus file read as books: a .jsonl (PG-19 columns; one book per row), a .parquet (one book per row, a
row group in memory at a time), or UTF-8 text (one book per file); any of them gzipped as .gz. Also `book_from_row`,
the one way a PG-19-style row (a file's or the Hub's) becomes a `Book`. corpus.py chooses the files and the source;
every error here is an `H2OStreamError` naming the file (and line or row) and what to do.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line

#: what a corpus may be: said by every error about a source that cannot be read
FORMATS = (
    "a corpus is 'sample', a .jsonl/.jsonl.gz (PG-19 columns), .parquet or UTF-8 text file, or a directory of them"
)
_HEAD_BYTES = 8192  # a NUL byte in this much of a file means it is binary


@dataclass(frozen=True)
class Book:
    """One book (or document): its title and its whole text."""

    title: str
    text: str


def file_books(path: Path) -> Iterator[Book]:
    """The books of file `path`, lazily, read by its name: .parquet, .jsonl, else text; .gz first through gzip."""
    if path.stat().st_size == 0:
        raise H2OStreamError(f"{path} is empty (0 bytes): there is no text in it")
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from _parquet_books(path)
        return
    try:
        f = open(path, "rb")  # noqa: SIM115 - only opening errors are the path's; the with below owns the file
    except OSError as exc:
        raise H2OStreamError(f"could not read {path} ({exc.strerror or exc}); {FORMATS}") from exc
    with f:
        # A .gz file is read through gzip and then like the file it compresses (x.jsonl.gz like x.jsonl).
        stream = gzip.GzipFile(fileobj=f, mode="rb") if name.endswith(".gz") else f
        name = name.removesuffix(".gz")
        if b"\0" in _read(path, stream.read, _HEAD_BYTES):
            raise H2OStreamError(
                f"{path} is not UTF-8 text: it looks like a binary file (it contains NUL bytes); "
                "pass a .jsonl, .parquet or plain text file instead"
            )
        stream.seek(0)
        if name.endswith(".jsonl"):
            yield from _jsonl_books(path, _lines(path, stream))
        else:
            yield _text_book(path, _read(path, stream.read))


def _read(path: Path, read, *args) -> bytes:
    """`read(*args)`, a damaged or truncated .gz file reported as one clear error."""
    try:
        return read(*args)
    except (OSError, EOFError, zlib.error) as exc:
        raise H2OStreamError(f"could not read {path} ({one_line(exc)}); is it a complete gzip file?") from exc


def _lines(path: Path, stream) -> Iterator[bytes]:
    while line := _read(path, stream.readline):
        yield line


def _with_text(path: Path, books: Iterator[Book]) -> Iterator[Book]:
    """`books` as they come, refused as a .txt of only whitespace is when none holds any text: a book of whitespace
    is held back until a book with text follows (it is tiny), so nothing is read from such a file before its error."""
    blank: list[Book] = []
    any_text = False
    for book in books:
        if not book.text.strip() and not any_text:
            blank.append(book)
            continue
        any_text = True
        yield from blank
        blank.clear()
        yield book
    if blank:
        raise H2OStreamError(f"{path} is empty (its {len(blank)} book(s) hold only whitespace): there is no text in it")


def _jsonl_books(path: Path, lines: Iterator[bytes]) -> Iterator[Book]:
    yield from _with_text(path, _jsonl_rows(path, lines))


def _jsonl_rows(path: Path, lines: Iterator[bytes]) -> Iterator[Book]:
    n_books = 0
    for lineno, raw in enumerate(lines, 1):  # binary lines split on b"\n" only, so line numbers match editors'
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, exc, raw, f"line {lineno}: ") from None
        if lineno == 1:
            line = line.removeprefix("\ufeff")
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise H2OStreamError(
                f"{path} line {lineno} is not valid JSON ({exc.msg} at column {exc.colno}); "
                "a .jsonl file needs one JSON object per line"
            ) from None
        n_books += 1
        yield book_from_row(row, where=f"{path} line {lineno}", fallback_title=f"{path.name}:{lineno}")
    if n_books == 0:
        raise H2OStreamError(f"{path} is empty (no JSON rows): there is no book in it")


def _parquet_books(path: Path) -> Iterator[Book]:
    yield from _with_text(path, _parquet_rows(path))


def _parquet_rows(path: Path) -> Iterator[Book]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise H2OStreamError(f"{path} is not a readable Parquet file ({one_line(exc)})") from exc
    names = parquet.schema_arrow.names
    if "text" not in names:
        raise H2OStreamError(
            f"{path} has no 'text' column (columns: {', '.join(names) or 'none'}); "
            "the corpus needs each book's text in a column named 'text'"
        )
    if parquet.metadata.num_rows == 0:
        raise H2OStreamError(f"{path} is empty (no rows): there is no book in it")
    columns = [c for c in ("short_book_title", "title", "text") if c in names]
    n = 0
    for group in range(parquet.num_row_groups):  # one row group in memory at a time
        try:
            rows = parquet.read_row_group(group, columns=columns)
        except (pa.ArrowException, OSError) as exc:  # a damaged data page: the footer read fine, the data does not
            raise H2OStreamError(
                f"{path} is damaged: row group {group} (after row {n}) cannot be read ({one_line(exc)})"
            ) from exc
        for batch in rows.to_batches(max_chunksize=8):
            for row in batch.to_pylist():
                n += 1
                yield book_from_row(row, where=f"{path} row {n}", fallback_title=f"{path.name}:{n}")


def _text_book(path: Path, data: bytes) -> Book:
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc, data) from None
    if not text.strip():
        raise H2OStreamError(f"{path} is empty (only whitespace): there is no text in it")
    return Book(title=Path(path.stem).stem if path.suffix.lower() == ".gz" else path.stem, text=text)


def book_from_row(row, *, where: str, fallback_title: str) -> Book:
    """A Book from a PG-19-style row: `text`, title from `short_book_title`, else `title`, else `fallback_title`."""
    if not isinstance(row, dict):
        raise H2OStreamError(
            f"{where} is a JSON {type(row).__name__}, not an object; each row must be an object "
            "with the book in a 'text' field"
        )
    if "text" not in row:
        raise H2OStreamError(
            f"{where} has no 'text' field (fields: {', '.join(map(str, row)) or 'none'}); "
            "each row needs the book's text in 'text'"
        )
    text = row["text"]
    if not isinstance(text, str):
        raise H2OStreamError(f"{where}: 'text' is {type(text).__name__}, not a string; it must hold the book's text")
    titles = (row.get("short_book_title"), row.get("title"))
    title = next((t for t in titles if isinstance(t, str) and t.strip()), fallback_title)
    return Book(title=title, text=text)


def _not_utf8(path: Path, exc: UnicodeDecodeError, data: bytes, where: str = "") -> H2OStreamError:
    return H2OStreamError(
        f"{path} is not UTF-8 text ({where}byte 0x{data[exc.start]:02x} at offset {exc.start}); "
        "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8"
    )
