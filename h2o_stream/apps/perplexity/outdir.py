"""The output directory of a sweep: checked to take files before the model loads, and held by one run at a time.

`claim(out)` creates `out` if needed, proves that a file can be written in it (a read-only directory, a full quota or
a path under a file fails here, before any work, not at the first checkpoint after it), takes an exclusive lock on
`out/.h2o-stream-ppl.lock` (flock: the kernel releases it when the process dies, even by SIGKILL) and records its pid
there, so that a second run into the same directory is refused with the holder's pid. Under the lock, leftovers of
writers killed mid-write are removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from h2o_stream.errors import H2OStreamError
from h2o_stream.files import probe_writable, remove_partials

LOCK_NAME = ".h2o-stream-ppl.lock"


@contextlib.contextmanager
def claim(out: str | os.PathLike) -> Iterator[Path]:
    """Hold the output directory `out` (see the module docstring) for the duration of the block. When the block
    fails before anything is written into `out`, what the claim made is removed again (its lock file, and the
    folders it created): a refused run leaves nothing behind, and a folder that was there before stays as it was."""
    out = Path(out).expanduser()
    created = next((path for path in reversed((out, *out.parents)) if not path.exists()), None)
    before = set(os.listdir(out)) if created is None and out.is_dir() else set()
    try:
        make_writable_dir(out)
        with _locked(out):
            remove_partials(out)
            try:
                yield out
            except BaseException:
                _undo(out, created, before)  # under the lock: no other run has taken the folder meanwhile
                raise
    except BaseException:
        _undo(out, created, before)
        raise


def _undo(out: Path, created: Path | None, before: set[str]) -> None:
    """Remove what a claim made in `out` when nothing else was written there since (`before`: the names it held):
    the lock file it created, then `out` and its parents up to `created` (the highest folder it made; None: none)
    while they are empty."""
    with contextlib.suppress(OSError):
        if not out.is_dir() or set(os.listdir(out)) - before - {LOCK_NAME}:
            return
        if LOCK_NAME not in before:
            (out / LOCK_NAME).unlink(missing_ok=True)
        if created is None:
            return
        for path in (out, *out.parents):
            path.rmdir()  # only an empty folder goes
            if path == created:
                break


def make_writable_dir(out: Path) -> None:
    """Create `out` (and its parents) and write a probe file in it; one H2OStreamError saying what is wrong."""
    for path in (out, *out.parents):
        if path.exists():
            if not path.is_dir():
                where = "is a file" if path == out else f"is under {path}, which is a file"
                raise H2OStreamError(f"--out {out} {where}; give a directory")
            break
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe_writable(out)
    except OSError as error:
        raise H2OStreamError(
            f"cannot write into --out {out} ({error.strerror or error}); choose a writable directory"
        ) from None


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    path = out / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as error:
        raise H2OStreamError(f"cannot create the lock file {path} ({error.strerror or error})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise H2OStreamError(
                f"{out} is in use by another h2o-stream ppl run (pid {holder}); wait for it to "
                "finish, or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a run about to lock it)
