"""Books to stream: PG-19's test split from the Hugging Face Hub, or a local corpus (.jsonl, .parquet, text, a directory).

Everything is lazy: `iter_books` is a generator that holds one book at a time, so a corpus larger than memory
streams fine. Bad input raises `H2OStreamError` with one line saying what is wrong and what to do.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line

HUB_PG19 = "emozilla/pg19-test"  # the widely used copy of the PG-19 test split
LOCAL_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md")  # what a directory is searched for
_USE_LOCAL = "pass a local corpus with --data PATH (.jsonl, .parquet, .txt or a directory of them)"
_HEAD_BYTES = 8192  # a NUL byte in this much of a file means it is binary
_NEED_BOOKS = "point --data at a corpus with at least one book"


@dataclass(frozen=True)
class Book:
    title: str
    text: str


def iter_books(source: str | os.PathLike | None) -> Iterator[Book]:
    """Yield the books of `source` in order: None = PG-19 test split from the Hub; else a file or a directory."""
    if source is None:
        yield from _hub_books()
        return
    if not os.fspath(source):
        raise H2OStreamError(f"the data path is empty; {_NEED_BOOKS}, or leave it out to read PG-19 from the Hub")
    path = Path(source)
    if not path.exists():
        raise H2OStreamError(f"no such file or directory: {path}; {_USE_LOCAL}")
    if not path.is_dir():
        yield from _file_books(path)
        return
    files = sorted(
        (p for p in path.rglob("*") if p.suffix.lower() in LOCAL_SUFFIXES and p.is_file()
         and not any(part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).parts,
    )
    if not files:
        raise H2OStreamError(f"no usable files in {path} (looked for {', '.join(LOCAL_SUFFIXES)})")
    for file in files:
        yield from _file_books(file)


def book_token_ids(book: Book, tokenizer) -> list[int]:
    """The book's token ids with the tokenizer's own special tokens (its BOS if it adds one); never truncated."""
    # verbose=False: a book is far longer than model_max_length, which is fine when streaming; skip that warning.
    encoding = tokenizer(book.text, add_special_tokens=True, truncation=False, verbose=False)
    return list(encoding["input_ids"])


def describe_source(source: str | os.PathLike | None) -> str:
    """One line for logs and result files, e.g. "gutenberg_pre1919.jsonl (local jsonl)"."""
    if source is None:
        return f"{HUB_PG19} (Hugging Face Hub, streaming)"
    path = Path(source)
    if path.is_dir():
        kind = "local directory"
    else:
        kind = {".jsonl": "local jsonl", ".parquet": "local parquet"}.get(path.suffix.lower(), "local text")
    return f"{path.name or path.resolve().name or path} ({kind})"


# --- the Hub ----------------------------------------------------------------------------------------


def _hub_books() -> Iterator[Book]:
    import datasets  # slow to import; only the Hub path needs it

    def failure(exc: Exception, books_read: int) -> H2OStreamError:
        what = ("could not load PG-19 from the Hugging Face Hub" if books_read == 0
                else f"lost the Hugging Face Hub after {books_read} PG-19 books")
        return H2OStreamError(f"{what} ({one_line(exc)}); {_USE_LOCAL}")

    try:
        rows = iter(datasets.load_dataset(HUB_PG19, split="test", streaming=True))
    except Exception as exc:  # connection errors, offline mode, a missing repo: all mean "use a local corpus"
        raise failure(exc, 0) from exc
    for n in itertools.count(1):
        try:
            row = next(rows)
        except StopIteration:
            if n == 1:
                raise H2OStreamError(f"{HUB_PG19} on the Hugging Face Hub has no rows; {_USE_LOCAL}") from None
            return
        except Exception as exc:
            raise failure(exc, n - 1) from exc
        yield _book(row, where=f"{HUB_PG19} row {n}", fallback_title=f"{HUB_PG19}:{n}")


# --- local files ------------------------------------------------------------------------------------


def _file_books(path: Path) -> Iterator[Book]:
    if path.stat().st_size == 0:
        raise H2OStreamError(f"{path} is empty; {_NEED_BOOKS}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet_books(path)
        return
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise H2OStreamError(f"could not read {path} ({exc.strerror or exc}); {_USE_LOCAL}") from exc
    with f:
        if b"\0" in f.read(_HEAD_BYTES):
            raise H2OStreamError(f"{path} is not UTF-8 text (it has NUL bytes: a binary file?); "
                                 "pass a .jsonl, .parquet or plain text file instead")
        f.seek(0)
        if suffix == ".jsonl":
            yield from _jsonl_books(path, f)
        else:
            yield _text_book(path, f.read())


def _jsonl_books(path: Path, f) -> Iterator[Book]:
    n_books = 0
    for lineno, raw in enumerate(f, 1):  # binary lines split on b"\n" only, so line numbers match editors'
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _not_utf8(path, f"line {lineno}: {exc.reason} at byte {exc.start}") from None
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
        yield _book(row, where=f"{path} line {lineno}", fallback_title=f"{path.name}:{lineno}")
    if n_books == 0:
        raise H2OStreamError(f"{path} is empty (no JSON rows); {_NEED_BOOKS}")


def _parquet_books(path: Path) -> Iterator[Book]:
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
        raise H2OStreamError(f"{path} is empty (no rows); {_NEED_BOOKS}")
    columns = [c for c in ("short_book_title", "title", "text") if c in names]
    n = 0
    for group in range(parquet.num_row_groups):  # one row group in memory at a time
        for batch in parquet.read_row_group(group, columns=columns).to_batches(max_chunksize=8):
            for row in batch.to_pylist():
                n += 1
                yield _book(row, where=f"{path} row {n}", fallback_title=f"{path.name}:{n}")


def _text_book(path: Path, data: bytes) -> Book:
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, f"{exc.reason} at byte {exc.start}") from None
    if not text.strip():
        raise H2OStreamError(f"{path} is empty (only whitespace); {_NEED_BOOKS}")
    return Book(title=path.stem, text=text)


# --- helpers ----------------------------------------------------------------------------------------


def _book(row, *, where: str, fallback_title: str) -> Book:
    """A Book from a PG-19-style row: `text`, title from `short_book_title`, else `title`, else `fallback_title`."""
    if not isinstance(row, dict):
        raise H2OStreamError(f"{where} is a JSON {type(row).__name__}, not an object; each row must be an object "
                             "with the book in a 'text' field")
    if "text" not in row:
        raise H2OStreamError(f"{where} has no 'text' field (fields: {', '.join(map(str, row)) or 'none'}); "
                             "each row needs the book's text in 'text'")
    text = row["text"]
    if not isinstance(text, str):
        raise H2OStreamError(f"{where}: 'text' is {type(text).__name__}, not a string; it must hold the book's text")
    titles = (row.get("short_book_title"), row.get("title"))
    title = next((t for t in titles if isinstance(t, str) and t.strip()), fallback_title)
    return Book(title=title, text=text)


def _not_utf8(path: Path, detail: str) -> H2OStreamError:
    return H2OStreamError(f"{path} is not UTF-8 text ({detail}); convert it to UTF-8, e.g. iconv -f latin1 -t utf-8")
