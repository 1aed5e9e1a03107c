"""Where the server keeps conversations on disk: one chat session file per conversation and turn (the chat's
verified format, `h2o_stream.apps.chat.session_file`: `h2o-stream chat --load` resumes any of them), and a small
index per conversation that names its current file.

    STATE_DIR/.h2o-stream-serve.lock          held (flock) while a server runs here: one server per directory
    STATE_DIR/conversations/ID.json           the index: the digest of the history the conversation holds, its
                                              turn count, its file, and the file of the turn before (for edits)
    STATE_DIR/conversations/ID.GEN.session    the session after a turn (GEN counts the conversation's commits)

ID is the name the client gave (or one made up for it), prefixed by `OWNER~` when an API key owns the
conversation (OWNER: `keys.owner_name`, from the key, never the key itself); conversations of a server without keys,
and those written before keys existed, have no prefix.

A turn is committed by writing its session file (atomically, fsynced) and then replacing the index; only then are
the conversation's older files removed. A crash or a full disk at any point leaves the index naming the last good
file. A file that fails its check when loaded is renamed to NAME.corrupt (kept for inspection, never read again)
and reported; the caller rebuilds the conversation from what the client sent.

The store keeps a running count of the bytes its conversations take (their indexes and session files) and of the
other files in the directory (set aside, or without an index), so that its size is known without walking it;
`to_remove` says which conversations must go for the directory to stay within its `Bounds`.
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
CONVERSATION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # what a client may name a conversation
OWNER_SEPARATOR = "~"  # between an owner and a conversation's name in its id: a character no name holds
STORED_ID = re.compile(rf"(?:[0-9a-f]{{16}}{OWNER_SEPARATOR})?{CONVERSATION_ID.pattern}")
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


def stored_id(owner: str, name: str) -> str:
    """The id conversation `name` of `owner` is kept under ("" : the owner of a server without keys)."""
    return f"{owner}{OWNER_SEPARATOR}{name}" if owner else name


def split_id(key: str) -> tuple[str, str]:
    """(owner, name) of a stored id."""
    owner, _, name = key.rpartition(OWNER_SEPARATOR)
    return owner, name


@dataclass(frozen=True)
class Bounds:
    """What the state directory may keep (None: no bound): conversations at most, bytes of conversations at most,
    and seconds a conversation is kept after its last turn."""

    max_conversations: int | None = None
    max_bytes: int | None = None
    expire_after: float | None = None


def to_remove(records: list[Record], sizes: dict[str, int], bounds: Bounds, now: float) -> list[Record]:
    """Which of `records` (those that may go) to remove, least recently used first: every one unused for longer than
    `bounds.expire_after`, then more until the store's count and bytes (`sizes`: every conversation's, including those
    that may not go) are within the bounds, or none is left to remove."""
    count, total = len(sizes), sum(sizes.values())
    chosen = []
    for record in sorted(records, key=lambda r: r.updated):
        expired = bounds.expire_after is not None and now - record.updated > bounds.expire_after
        over = (bounds.max_conversations is not None and count > bounds.max_conversations) or (
            bounds.max_bytes is not None and total > bounds.max_bytes
        )
        if not (expired or over):
            break  # the rest were used more recently: none of them is expired, and the bounds hold
        chosen.append(record)
        count, total = count - 1, total - sizes.get(record.id, 0)
    return chosen


class Store:
    """The conversations directory of one server (see the module docstring). `open()` takes the lock and reads the
    indexes; `records` then holds every conversation on disk, `sizes` the bytes of each, `bytes` those of the
    whole directory."""

    def __init__(self, directory: str | os.PathLike):
        self.root = Path(directory).expanduser()
        self.dir = self.root / "conversations"
        self.records: dict[str, Record] = {}
        self.sizes: dict[str, int] = {}  # id -> bytes of its index and session files
        self.other_bytes = 0  # files of no conversation served: set aside (.corrupt) or without an index
        self._conversation_bytes = 0  # sum(sizes.values()), kept as it changes
        self._lock_fd: int | None = None

    @property
    def bytes(self) -> int:
        """The size of the conversations directory."""
        return self._conversation_bytes + self.other_bytes

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
            self._measure(record)
        self.other_bytes = sum(_file_size(p) for p in self.dir.iterdir() if p.is_file()) - self._conversation_bytes
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
        self._measure(record)

    def remove(self, record: Record) -> None:
        """Remove a conversation: its index first (from then on it is gone, even if the server dies before its
        session files are), then its session files. OSError if the index cannot be removed: it stays."""
        self.path(f"{record.id}.json").unlink(missing_ok=True)
        for path in self.dir.glob(f"{record.id}.*.session"):
            with contextlib.suppress(OSError):
                path.unlink()
        del self.records[record.id]
        self._conversation_bytes -= self.sizes.pop(record.id, 0)

    def quarantine(self, path: Path, why: str) -> str:
        """Rename a file that failed its check to NAME.corrupt and say so (logged and returned)."""
        aside = path.with_name(path.name + ".corrupt")
        size = _file_size(path)
        try:
            os.replace(path, aside)
            where = f"moved to {aside.name}"
            record = self.records.get(path.name.split(".")[0])
            if record is not None and record.id in self.sizes:  # its bytes move from the conversation to the others
                self.other_bytes += size
                self._measure(record)
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

    def _measure(self, record: Record) -> None:
        size = sum(_file_size(self.path(n)) for n in (f"{record.id}.json", record.file, record.prev_file) if n)
        self._conversation_bytes += size - self.sizes.get(record.id, 0)
        self.sizes[record.id] = size


def _file_size(path: Path) -> int:
    """The size of a file, 0 when there is none (or it cannot be seen)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


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
    if record.id != path.stem or not STORED_ID.fullmatch(record.id):
        raise ValueError(f"the index names another conversation ({record.id!r})")
    for name in (record.file, record.prev_file):
        if name is not None and (
            not isinstance(name, str) or not re.fullmatch(rf"{re.escape(record.id)}\.\d+\.session", name)
        ):
            raise ValueError(f"the index names a file outside its conversation ({name!r})")
    if (record.prev is None) != (record.prev_file is None):
        raise ValueError("the index names a previous turn without its file")
    record.updated = float(record.updated) if isinstance(record.updated, (int, float)) else time.time()
    return record
