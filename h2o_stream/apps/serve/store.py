"""Where the server keeps conversations on disk: one chat session file per conversation and turn (the chat's
verified format, `h2o_stream.apps.chat.session_file`: `h2o-stream chat --load` resumes any of them), and a small
index per conversation that names its current file.

    STATE_DIR/.h2o-stream-serve.lock          held (flock) while a server runs here: one server per directory
    STATE_DIR/conversations/ID.json           the index: the digest of the history the conversation holds, its
                                              turn count, its file, and the file of the turn before (for edits)
    STATE_DIR/conversations/ID.GEN.session    the session after a turn (GEN counts the conversation's commits)

A turn is committed by writing its session file (atomically, fsynced) and then replacing the index; only then are
the conversation's older files removed. A crash or a full disk at any point leaves the index naming the last good
file. A file that fails its check when loaded is renamed to NAME.corrupt (kept for inspection, never read again)
and reported; the caller rebuilds the conversation from what the client sent.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.files import remove_partials, write_json

LOCK_NAME = ".h2o-stream-serve.lock"
INDEX_KIND = "h2o-stream serve conversation"
INDEX_VERSION = 1
CONVERSATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # also what a client may name a conversation
log = logging.getLogger("h2o_stream.serve")


class NotSaved(H2OStreamError):
    """A turn could not be written (a full disk, a read-only directory): the conversation stays as it was."""


@dataclass
class Record:
    """A conversation as its index says: the history digest `head` after `turns` turns, held by `file`; `prev` and
    `prev_file` the same one turn earlier, when kept."""

    id: str
    root: str  # digest of the system prompt and cache settings
    turns: int
    head: str
    file: str
    generation: int
    prev: str | None = None
    prev_file: str | None = None
    updated: float = 0.0


class Store:
    """The conversations directory of one server (see the module docstring). `open()` takes the lock and reads the
    indexes; `records` then holds every conversation on disk."""

    def __init__(self, directory: str | os.PathLike):
        self.root = Path(directory).expanduser()
        self.dir = self.root / "conversations"
        self.records: dict[str, Record] = {}
        self._lock_fd: int | None = None

    def open(self) -> list[str]:
        """Take the directory, clean up what a killed server left half-written, read the indexes; notices to report
        (indexes that could not be read, files without an index)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise H2OStreamError(f"cannot use --state-dir {self.root}: {error.strerror or error}") from None
        self._lock()
        remove_partials(self.dir)
        notices = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                record = _read_index(path)
            except ValueError as error:
                notices.append(self.quarantine(path, str(error)))
                continue
            self.records[record.id] = record
        for record in self.records.values():
            self._remove_unreferenced(record)
        unindexed = {p.name.split(".")[0] for p in self.dir.glob("*.session")} - set(self.records)
        if unindexed:
            notices.append(
                f"{len(unindexed)} conversation(s) in {self.dir} have session files but no readable index "
                "and are not served; their files are kept"
            )
        return notices

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    def _lock(self) -> None:
        path = self.root / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as error:
            raise H2OStreamError(f"cannot create {path} ({error.strerror or error})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise H2OStreamError(
                f"{self.root} is in use by another h2o-stream serve (pid {holder}); stop it or give another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def path(self, name: str) -> Path:
        return self.dir / name

    def commit(self, record: Record, session) -> None:
        """Make `record` (whose `file` is new) the conversation's state, with `session` written to its file; the
        conversation's other files except `prev_file` go. NotSaved if the disk refuses: the index and files
        are then as before."""
        from h2o_stream.apps.chat import session_file

        target = self.path(record.file)
        try:
            session_file.save(session, target)
            write_json(self.path(f"{record.id}.json"), {"kind": INDEX_KIND, "version": INDEX_VERSION, **asdict(record)})
        except (H2OStreamError, OSError) as error:
            with contextlib.suppress(OSError):
                target.unlink(missing_ok=True)
            why = str(error) if isinstance(error, H2OStreamError) else (error.strerror or one_line(error))
            raise NotSaved(
                f"conversation {record.id} could not be saved ({why}); it stays at its last completed turn"
            ) from None
        self.records[record.id] = record
        self._remove_unreferenced(record)

    def quarantine(self, path: Path, why: str) -> str:
        """Rename a file that failed its check to NAME.corrupt and say so (logged and returned)."""
        aside = path.with_name(path.name + ".corrupt")
        try:
            os.replace(path, aside)
            where = f"moved to {aside.name}"
        except OSError as error:
            where = f"left in place ({error.strerror or error})"
        notice = f"refused {path.name}: {why}; {where}"
        log.warning(notice)
        return notice

    def _remove_unreferenced(self, record: Record) -> None:
        keep = {record.file, record.prev_file}
        for path in self.dir.glob(f"{record.id}.*.session"):
            if path.name not in keep:
                with contextlib.suppress(OSError):
                    path.unlink()


def _read_index(path: Path) -> Record:
    """A conversation index, checked; ValueError saying what is wrong."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"the index cannot be read ({one_line(error)})") from None
    if not isinstance(data, dict) or data.get("kind") != INDEX_KIND or data.get("version") != INDEX_VERSION:
        raise ValueError(f"not a {INDEX_KIND} index of version {INDEX_VERSION}")
    names = {f.name for f in fields(Record)}
    try:
        record = Record(**{k: v for k, v in data.items() if k in names})
    except TypeError as error:
        raise ValueError(f"the index lacks a field ({error})") from None
    types = {"id": str, "root": str, "turns": int, "head": str, "file": str, "generation": int}
    if (
        not all(
            isinstance(getattr(record, k), t) and not isinstance(getattr(record, k), bool) for k, t in types.items()
        )
        or record.turns < 1
    ):
        raise ValueError("the index has a field of the wrong type")
    if record.id != path.stem or not CONVERSATION_ID.fullmatch(record.id):
        raise ValueError(f"the index names another conversation ({record.id!r})")
    for name in (record.file, record.prev_file):
        if name is not None and (not isinstance(name, str) or not re.fullmatch(rf"{record.id}\.\d+\.session", name)):
            raise ValueError(f"the index names a file outside its conversation ({name!r})")
    if (record.prev is None) != (record.prev_file is None):
        raise ValueError("the index names a previous turn without its file")
    record.updated = float(record.updated) if isinstance(record.updated, (int, float)) else time.time()
    return record
