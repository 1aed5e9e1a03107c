"""Writing files so that a reader never sees half of one, and reading back only what h2o-stream wrote, intact.

- `atomic_path(path)` / `write_json(path, data)`: the one atomic writer every module uses (JSON is strict: no NaN).
- `write_verified(path, kind, version, data)` / `read_verified(path, kind, version)`: the one format for files the tool
  reads back (perplexity checkpoints, chat sessions). `data` is plain data: tensors, numbers, text, None, and lists,
  tuples and dicts of them. The file is a magic line, a one-line JSON header (kind, version, byte count and sha256 of
  the body) and the body as written by `torch.save`. Reading checks the header and the digest before anything is
  deserialized, then deserializes with torch's `weights_only` unpickler, so a flipped byte is an error and a crafted
  file cannot run code. Any problem raises `UnverifiedFile`, whose message completes the sentence "<path> ...".
- `not_ours(path, kind)`: the one rule for writing where a file may already be: what is there is replaced without
  being told only when it is a verified file of the same kind (an older save of the same thing); a user's text, a
  JSON file or a verified file of another kind is not.
- `remove_partials(directory)`: delete what writers killed mid-write left behind (call it only while holding the
  directory, e.g. under a lock).

This module sits in the bottom layer (it may not import h2o_stream.errors); callers turn `UnverifiedFile` and
`OSError` into their own user-facing messages.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

MAGIC = b"h2o-stream verified file\n"
_HEADER_LIMIT = 4096  # bytes; a header line longer than this is not ours
#: test hook: seconds to pause halfway through writing a verified file's body (fault-injection tests kill it there)
WRITE_DELAY_ENV = "H2O_STREAM_TEST_WRITE_DELAY"


class UnverifiedFile(Exception):
    """A file `read_verified` refuses. The message completes "<path> ...", e.g. "is damaged: ..."; `found_kind` and
    `found_version` say what the header claims, where there is one."""

    def __init__(self, message: str, *, found_kind: str | None = None, found_version: int | None = None):
        super().__init__(message)
        self.found_kind = found_kind
        self.found_version = found_version


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step, on any error it is removed
    and `path` is left as it was.

    The temporary name keeps the target's suffix (`x.json` -> `x.json.<pid>.tmp.json`) so that writers which pick a
    format from the suffix (matplotlib) still do; it lives in the same directory, where `os.replace` is atomic.
    """
    target = Path(path)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp{target.suffix}")
    try:
        yield partial
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):  # the original error matters, not a failed clean-up (read-only disk)
            partial.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data) -> None:
    """`data` as indented JSON at `path`, atomically. Strict JSON: NaN or infinity is a ValueError, never written."""
    text = json.dumps(data, indent=1, allow_nan=False) + "\n"  # before the file exists: a bad value writes nothing
    with atomic_path(path) as partial, open(partial, "w") as f:
        f.write(text)


def write_verified(path: str | os.PathLike, kind: str, version: int, data) -> None:
    """`data` (plain data, see the module docstring) at `path` as a verified file of `kind` and `version`: atomically,
    on disk (fsync) before it replaces an older file, so that a crash or a full disk keeps the last good one."""
    import torch

    buffer = io.BytesIO()
    torch.save(data, buffer)
    body = buffer.getvalue()
    header = {"kind": kind, "version": version, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    target = Path(path)
    with atomic_path(target) as partial, open(partial, "wb") as file:
        file.write(MAGIC + json.dumps(header).encode() + b"\n")
        _write_body(file, body)
        file.flush()
        os.fsync(file.fileno())
    with contextlib.suppress(OSError):  # make the rename itself durable; not possible everywhere (some filesystems)
        directory = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def _write_body(file, body: bytes) -> None:
    """The body's bytes; with the test hook set, half of them, a pause, then the rest (tests replace this function
    to simulate a full disk)."""
    delay = float(os.environ.get(WRITE_DELAY_ENV) or 0)
    if delay:
        file.write(body[: len(body) // 2])
        file.flush()
        time.sleep(delay)
        body = body[len(body) // 2 :]
    file.write(body)


def read_verified(path: str | os.PathLike, kind: str, version: int, *, map_location="cpu"):
    """The data of the verified file at `path`, if it is an intact file of `kind` and `version`; else UnverifiedFile.
    Nothing is deserialized before the header and digest check out, and then only plain data (weights_only)."""
    import torch

    path = Path(path)
    try:
        with open(path, "rb") as file:
            magic = file.read(len(MAGIC))
            if magic != MAGIC:
                raise UnverifiedFile(
                    "is not a file written by h2o-stream (or one from a version before verified files)"
                )
            line = file.readline(_HEADER_LIMIT)
            body = file.read()
    except IsADirectoryError:
        raise UnverifiedFile("is a directory, not a file") from None
    except FileNotFoundError:
        raise UnverifiedFile("does not exist") from None
    except OSError as error:
        raise UnverifiedFile(f"cannot be read ({error.strerror or error})") from None
    header = _header(line)
    found_kind, found_version = header["kind"], header["version"]
    if found_kind != kind:
        raise UnverifiedFile(
            f"is not a {kind}: it is a {found_kind}", found_kind=found_kind, found_version=found_version
        )
    if found_version != version:
        raise UnverifiedFile(
            f"is a {kind} of format version {found_version}; this h2o-stream reads version {version}",
            found_kind=found_kind,
            found_version=found_version,
        )
    if len(body) != header["bytes"]:
        raise UnverifiedFile(
            f"is truncated or damaged: it holds {len(body):,} bytes of data, its header says {header['bytes']:,}",
            found_kind=found_kind,
            found_version=found_version,
        )
    if hashlib.sha256(body).hexdigest() != header["sha256"]:
        raise UnverifiedFile(
            "is damaged: its contents do not match their checksum", found_kind=found_kind, found_version=found_version
        )
    try:
        return torch.load(io.BytesIO(body), map_location=map_location, weights_only=True)
    except Exception as error:  # noqa: BLE001 - weights_only refusing code, or a broken archive: the same answer
        raise UnverifiedFile(
            f"holds something other than plain data, which h2o-stream never writes "
            f"({type(error).__name__}); it was not loaded",
            found_kind=found_kind,
            found_version=found_version,
        ) from None


def not_ours(path: str | os.PathLike, kind: str) -> str | None:
    """None when a verified file of `kind` may be written at `path` without asking: nothing is there, or a verified
    file of that same kind (of any version, even a damaged one). Else what is there, completing "<path> ...", e.g.
    "is not a file written by h2o-stream": a writer replaces it only when told to (a --force)."""
    try:
        with open(path, "rb") as file:
            magic = file.read(len(MAGIC))
            line = file.readline(_HEADER_LIMIT) if magic == MAGIC else b""
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        return "is a directory"
    except OSError as error:
        return f"exists and cannot be read ({error.strerror or error})"
    if magic != MAGIC:
        return "is not a file written by h2o-stream"
    try:
        found = _header(line)["kind"]
    except UnverifiedFile:
        return "is an h2o-stream file whose header is not readable"
    return None if found == kind else f"is a {found}"


def _header(line: bytes) -> dict:
    """The JSON header line of a verified file, checked for the fields `read_verified` needs."""
    try:
        header = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        header = None
    if not (
        isinstance(header, dict)
        and isinstance(header.get("kind"), str)
        and isinstance(header.get("version"), int)
        and isinstance(header.get("bytes"), int)
        and isinstance(header.get("sha256"), str)
    ):
        raise UnverifiedFile("is damaged: its header is not readable")
    return header


_PARTIAL = re.compile(r"(?P<target>.+)\.(?P<pid>\d+)\.tmp(?P<suffix>\.[^.]*)?")


def probe_writable(folder: str | os.PathLike) -> None:
    """Create a file in `folder` and remove it again: an OSError if `folder` takes no new file (read-only, full,
    /proc), found before any work rather than at the end of it."""
    fd, probe = tempfile.mkstemp(dir=folder, prefix=".h2o-stream-write-probe-")
    try:
        os.write(fd, b"probe")
    finally:
        os.close(fd)
        os.unlink(probe)


def is_partial(path: str | os.PathLike) -> bool:
    """Whether `path` is named as `atomic_path` names a file it is still writing (x.json.<pid>.tmp.json): another
    process's result in the making, or one a killed process left. Never a user's x.2024.tmp."""
    match = _PARTIAL.fullmatch(Path(path).name)
    return bool(match and match["suffix"] and match["suffix"] == Path(match["target"]).suffix)


def remove_partials(directory: str | os.PathLike) -> list[Path]:
    """Delete the temporary files `atomic_path` leaves when its process is killed mid-write; the paths deleted.
    Only for a directory this process holds (no other writer may be working in it)."""
    removed = []
    for entry in Path(directory).iterdir():
        if is_partial(entry) and entry.is_file():
            with contextlib.suppress(OSError):
                entry.unlink()
                removed.append(entry)
    return removed
