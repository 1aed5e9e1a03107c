"""Books and documents, read one way for every command: the shipped sample, PG-19's test split from the Hugging Face
Hub, or a local corpus (.jsonl or .jsonl.gz with PG-19 columns, .parquet, UTF-8 text, a directory of them).

Everything is lazy: `iter_books` is a generator that holds one book at a time, so a corpus larger than memory
streams fine. `read_book` picks one book (by index or title) for commands that read a single document. Bad input
raises `H2OStreamError` with one line saying what is wrong and what to do.
"""

from __future__ import annotations

import gzip
import hashlib
import itertools
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line

HUB_PG19 = "emozilla/pg19-test"  # the widely used copy of the PG-19 test split
SAMPLE = "sample"  # the name that selects the shipped sample (a local folder of that name: write ./sample)
SAMPLE_FILE = Path(__file__).with_name("sample") / "gutenberg.jsonl.gz"  # provenance in sample/README.md
SAMPLE_TITLES = ("Pride and Prejudice", "Frankenstein", "Moby Dick; or, The Whale",
                 "The Adventures of Sherlock Holmes", "The Time Machine")
LOCAL_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md", ".jsonl.gz", ".txt.gz")  # what a directory is searched for
_FORMATS = "a corpus is 'sample', a .jsonl/.jsonl.gz (PG-19 columns), .parquet or UTF-8 text file, or a directory of them"
_USE_LOCAL = f"pass --data sample or a local corpus with --data PATH ({_FORMATS})"
_HEAD_BYTES = 8192  # a NUL byte in this much of a file means it is binary


@dataclass(frozen=True)
class Book:
    """One book (or document): its title and its whole text."""
    title: str
    text: str


def iter_books(source: str | os.PathLike | None) -> Iterator[Book]:
    """Yield the books of `source` in order: None = PG-19 test split from the Hub; "sample" = the shipped sample;
    else a file or a directory."""
    if source is None:
        yield from _hub_books()
        return
    path = _local_path(source)
    if not path.exists():
        raise H2OStreamError(f"no such file or directory: {path} ({_FORMATS})")
    if not path.is_dir():
        yield from _file_books(path)
        return
    for file in _directory_files(path):
        yield from _file_books(file)


def corpus_digest(source: str | os.PathLike | None) -> tuple[int, str] | None:
    """(bytes, sha256) of what `source` reads: a file's bytes, or for a directory the names and bytes of every file
    `iter_books` reads there, in its order; None for the Hub's split, which is not read as local bytes. What a
    result records of its corpus, so that a run is bound to its text and not to where that text lies."""
    if source is None:
        return None
    path = SAMPLE_FILE if _is_sample(source) else _local_path(source)
    if not path.exists():
        raise H2OStreamError(f"no such file or directory: {path} ({_FORMATS})")
    files = _directory_files(path) if path.is_dir() else [path]
    sha, size = hashlib.sha256(), 0
    for file in files:
        if path.is_dir():
            sha.update(f"{file.relative_to(path).as_posix()}\0{file.stat().st_size}\0".encode())
        with open(file, "rb") as stream:
            for block in iter(lambda: stream.read(1 << 20), b""):
                sha.update(block)
                size += len(block)
    return size, sha.hexdigest()


def _directory_files(path: Path) -> list[Path]:
    """The files of directory `path` that make its corpus, in reading order (hidden ones left out)."""
    files = sorted(
        (p for p in path.rglob("*") if p.name.lower().endswith(LOCAL_SUFFIXES) and p.is_file()
         and not any(part.startswith(".") for part in p.relative_to(path).parts)),
        key=lambda p: p.relative_to(path).parts,
    )
    if not files:
        raise H2OStreamError(f"no usable files in {path} (looked for {', '.join(LOCAL_SUFFIXES)})")
    return files


def book_token_ids(book: Book, tokenizer) -> list[int]:
    """The book's token ids with the tokenizer's own special tokens (its BOS if it adds one); never truncated."""
    # verbose=False: a book is far longer than model_max_length, which is fine when streaming; skip that warning.
    encoding = tokenizer(book.text, add_special_tokens=True, truncation=False, verbose=False)
    return list(encoding["input_ids"])


def describe_source(source: str | os.PathLike | None) -> str:
    """One line for logs and result files, e.g. "sample: 5 Gutenberg books shipped with h2o-stream 0.1.0 (...)"."""
    if source is None:
        return f"{HUB_PG19} (Hugging Face Hub, streaming)"
    if _is_sample(source):
        return (f"{SAMPLE}: {len(SAMPLE_TITLES)} Gutenberg books shipped with h2o-stream {_version()} "
                f"({' / '.join(SAMPLE_TITLES)})")
    path = Path(source)
    name = path.name.lower()
    if path.is_dir():
        kind = "local directory"
    elif name.endswith(".gz"):
        kind = "local jsonl, gzip" if name.endswith(".jsonl.gz") else "local text, gzip"
    else:
        kind = {".jsonl": "local jsonl", ".parquet": "local parquet"}.get(path.suffix.lower(), "local text")
    return f"{path.name or path.resolve().name or path} ({kind})"


# --- one book of a corpus ---------------------------------------------------------------------------------------


def list_books(source: str | os.PathLike) -> list[tuple[int, str]]:
    """(index, title) of every book of `source`, in order."""
    return [(i, book.title) for i, book in enumerate(iter_books(source))]


def read_book(source: str | os.PathLike, book: int | str | None = None) -> tuple[int, Book]:
    """(index, book) of one book of `source`: the only one when `book` is None, else the one `book` names: an index,
    or a title (case-insensitive; an exact title first, else the one title that contains it)."""
    label = SAMPLE if _is_sample(source) else str(_local_path(source))
    key = None if book is None else str(book).strip()
    index = int(key) if key is not None and (isinstance(book, int) or key.lstrip("-").isdigit()) else None
    chosen: tuple[int, Book] | None = None
    first_partial: tuple[int, Book] | None = None
    partial: list[tuple[int, str]] = []
    titles: list[str] = []
    for i, candidate in enumerate(iter_books(source)):
        titles.append(candidate.title)
        if book is None or index is not None:
            if i == (index or 0):
                chosen = (i, candidate)
            if index is not None and chosen is not None:
                break
        elif candidate.title.lower() == key.lower():
            chosen = (i, candidate)  # an exact title wins over any partial match, earlier or later
            break
        elif key and key.lower() in candidate.title.lower():
            partial.append((i, candidate.title))
            first_partial = first_partial or (i, candidate)
    if not titles:
        raise H2OStreamError(f"{label} holds no books")
    examples = ", ".join(f"{i}: {t!r}" for i, t in enumerate(titles[:5])) + (", ..." if len(titles) > 5 else "")
    if book is None and len(titles) > 1:
        raise H2OStreamError(f"{label} holds {len(titles)} books: choose one by index or title (--book / book=), "
                             f"e.g. {examples}")
    if chosen is None and len(partial) > 1:
        names = ", ".join(repr(t) for _, t in partial[:5])
        raise H2OStreamError(f"book {book!r} matches {len(partial)} titles ({names}): be more specific")
    chosen = chosen or first_partial
    if chosen is None:
        count = f"{len(titles)} books, indices 0-{len(titles) - 1}" if len(titles) > 1 else "1 book, index 0"
        raise H2OStreamError(f"no book {book!r} in {label} ({count}): e.g. {examples}")
    if not chosen[1].text.strip():
        raise H2OStreamError(f"book {chosen[0]} ({chosen[1].title!r}) of {label} is empty: it has no text")
    return chosen


# --- the Hub ----------------------------------------------------------------------------------------------------


def _hub_books() -> Iterator[Book]:
    from .sources import hub_unreachable  # offline: fail in seconds, not after a minute of retries

    unreachable = hub_unreachable()
    if unreachable:
        raise H2OStreamError(f"could not load PG-19 from the Hugging Face Hub ({unreachable}); {_USE_LOCAL}")
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


# --- local files ------------------------------------------------------------------------------------------------


def corpus_directory(source: str | os.PathLike | None) -> Path | None:
    """The directory whose files make the corpus `source` (all of them, read recursively), or None when it is not a
    local directory: what an output directory must stay out of."""
    if source is None or _is_sample(source) or not os.fspath(source):
        return None
    path = _local_path(source)
    return path.resolve() if path.is_dir() else None


def _is_sample(source) -> bool:
    return source is not None and os.fspath(source) == SAMPLE


def _local_path(source: str | os.PathLike) -> Path:
    if not os.fspath(source):
        raise H2OStreamError(f"the data path is empty ({_FORMATS}); leave it out to read PG-19 from the Hub")
    return SAMPLE_FILE if _is_sample(source) else Path(source).expanduser()


def _file_books(path: Path) -> Iterator[Book]:
    if path.stat().st_size == 0:
        raise H2OStreamError(f"{path} is empty (0 bytes): there is no text in it")
    name = path.name.lower()
    if name.endswith(".parquet"):
        yield from _parquet_books(path)
        return
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise H2OStreamError(f"could not read {path} ({exc.strerror or exc}); {_FORMATS}") from exc
    with f:
        # A .gz file is read through gzip and then like the file it compresses (x.jsonl.gz like x.jsonl).
        stream = gzip.GzipFile(fileobj=f, mode="rb") if name.endswith(".gz") else f
        name = name.removesuffix(".gz")
        if b"\0" in _read(path, stream.read, _HEAD_BYTES):
            raise H2OStreamError(f"{path} is not UTF-8 text: it looks like a binary file (it contains NUL bytes); "
                                 "pass a .jsonl, .parquet or plain text file instead")
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
        yield _book(row, where=f"{path} line {lineno}", fallback_title=f"{path.name}:{lineno}")
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
            raise H2OStreamError(f"{path} is damaged: row group {group} (after row {n}) cannot be read "
                                 f"({one_line(exc)})") from exc
        for batch in rows.to_batches(max_chunksize=8):
            for row in batch.to_pylist():
                n += 1
                yield _book(row, where=f"{path} row {n}", fallback_title=f"{path.name}:{n}")


def _text_book(path: Path, data: bytes) -> Book:
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise _not_utf8(path, exc, data) from None
    if not text.strip():
        raise H2OStreamError(f"{path} is empty (only whitespace): there is no text in it")
    return Book(title=Path(path.stem).stem if path.suffix.lower() == ".gz" else path.stem, text=text)


# --- helpers ----------------------------------------------------------------------------------------------------


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


def _not_utf8(path: Path, exc: UnicodeDecodeError, data: bytes, where: str = "") -> H2OStreamError:
    return H2OStreamError(f"{path} is not UTF-8 text ({where}byte 0x{data[exc.start]:02x} at offset {exc.start}); "
                          "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("h2o-stream")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
