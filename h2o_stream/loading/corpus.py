"""Books and documents, read one way for every command: the shipped sample, PG-19's test split from the Hugging Face
Hub, or a local corpus (.jsonl or .jsonl.gz with PG-19 columns, .parquet, UTF-8 text, a directory of them).

Everything is lazy: `iter_books` is a generator that holds one book at a time, so a corpus larger than memory
streams fine. `read_book` picks one book (by index or title) for commands that read a single document;
`parse_books` reads a selection of books by index (--books). Bad input
raises `H2OStreamError` with one line saying what is wrong and what to do. This module picks the source and the
files; corpus_files.py reads each file (jsonl, parquet, text, gzipped or not) as books.
"""

from __future__ import annotations

import hashlib
import itertools
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line

from .corpus_files import FORMATS, Book, book_from_row, file_books

HUB_PG19 = "emozilla/pg19-test"  # the widely used copy of the PG-19 test split
SAMPLE = "sample"  # the name that selects the shipped sample (a local folder of that name: write ./sample)
SAMPLE_FILE = Path(__file__).with_name("sample") / "gutenberg.jsonl.gz"  # provenance in sample/README.md
SAMPLE_TITLES = (
    "Pride and Prejudice",
    "Frankenstein",
    "Moby Dick; or, The Whale",
    "The Adventures of Sherlock Holmes",
    "The Time Machine",
)
LOCAL_SUFFIXES = (".jsonl", ".parquet", ".txt", ".md", ".jsonl.gz", ".txt.gz")  # what a directory is searched for
_USE_LOCAL = f"pass --data sample or a local corpus with --data PATH ({FORMATS})"


def iter_books(source: str | os.PathLike | None) -> Iterator[Book]:
    """Yield the books of `source` in order: None = PG-19 test split from the Hub; "sample" = the shipped sample;
    else a file or a directory."""
    if source is None:
        yield from _hub_books()
        return
    path = _local_path(source)
    if not path.exists():
        raise H2OStreamError(f"no such file or directory: {path} ({FORMATS})")
    if not path.is_dir():
        yield from file_books(path)
        return
    for file in _directory_files(path):
        yield from file_books(file)


def corpus_digest(source: str | os.PathLike | None) -> tuple[int, str] | None:
    """(bytes, sha256) of what `source` reads: a file's bytes, or for a directory the names and bytes of every file
    `iter_books` reads there, in its order; None for the Hub's split, which is not read as local bytes. What a
    result records of its corpus, so that a run is bound to its text and not to where that text lies."""
    if source is None:
        return None
    path = SAMPLE_FILE if _is_sample(source) else _local_path(source)
    if not path.exists():
        raise H2OStreamError(f"no such file or directory: {path} ({FORMATS})")
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
        (
            p
            for p in path.rglob("*")
            if p.name.lower().endswith(LOCAL_SUFFIXES)
            and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ),
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
        return (
            f"{SAMPLE}: {len(SAMPLE_TITLES)} Gutenberg books shipped with h2o-stream {_version()} "
            f"({' / '.join(SAMPLE_TITLES)})"
        )
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
        if key is None or index is not None:  # key is None exactly when book is
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
        raise H2OStreamError(
            f"{label} holds {len(titles)} books: choose one by index or title (--book / book=), e.g. {examples}"
        )
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


# --- a selection of books ------------------------------------------------------------------------------------


def parse_books(text: str) -> tuple[int, ...]:
    """Book indices from a list of indices and ranges, e.g. "1-20" or "0,3,5-7" (0-based, as `--book` counts them),
    sorted, each once; H2OStreamError for anything else."""
    indices: set[int] = set()
    for item in text.replace(" ", "").split(","):
        first, dash, last = item.partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise H2OStreamError(
                f"--books {text!r}: {item!r} is not a book index or a range of them (e.g. 0,3,5-7; indices from 0)"
            )
        low, high = int(first), int(last) if dash else int(first)
        if high < low:
            raise H2OStreamError(f"--books {text!r}: the range {item!r} ends before it starts")
        indices.update(range(low, high + 1))
    return tuple(sorted(indices))


def books_text(books: Iterable[int]) -> str:
    """Book indices written as `parse_books` reads them, ranges joined: (1, 2, 3, 7) -> "1-3,7"."""
    runs: list[list[int]] = []
    for index in sorted(set(books)):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in runs)


# --- the Hub ----------------------------------------------------------------------------------------------------


def _hub_books() -> Iterator[Book]:
    from .sources import hub_unreachable  # offline: fail at once with the reason, not after the Hub client's retries

    unreachable = hub_unreachable()
    if unreachable:
        raise H2OStreamError(f"could not load PG-19 from the Hugging Face Hub ({unreachable}); {_USE_LOCAL}")
    import datasets  # slow to import; only the Hub path needs it

    def failure(exc: Exception, books_read: int) -> H2OStreamError:
        what = (
            "could not load PG-19 from the Hugging Face Hub"
            if books_read == 0
            else f"lost the Hugging Face Hub after {books_read} PG-19 books"
        )
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
        yield book_from_row(row, where=f"{HUB_PG19} row {n}", fallback_title=f"{HUB_PG19}:{n}")


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
        raise H2OStreamError(f"the data path is empty ({FORMATS}); leave it out to read PG-19 from the Hub")
    return SAMPLE_FILE if _is_sample(source) else Path(source).expanduser()


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("h2o-stream")
    except PackageNotFoundError:  # a source tree that was never installed
        return "0+unknown"
