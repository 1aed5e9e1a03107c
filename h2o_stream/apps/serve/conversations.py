"""Which conversation a request continues, and the conversations held in memory (at most `capacity`, least
recently used dropped first: every completed turn is on disk already, so dropping one costs nothing).

A request is matched to what the server holds by its history's digests (`history.History.prefix`):

- a conversation whose history is the longest prefix of the request's is continued in place; only the exchanges
  the request has beyond it (normally none) and the new message are fed;
- else, a conversation whose history one turn back is such a prefix (the client edited, regenerated or deleted the
  last turn) is branched: a new conversation starts from that earlier file, the old one stays as it was;
- else a new conversation starts from an empty cache, and every exchange the request carries is fed (replayed).

With a conversation id (the `X-Conversation-Id` header), that conversation is the one used: continued, rewound to
its previous turn, or rebuilt from scratch, whichever its history allows; an unknown id starts a new conversation
under that name. Requests for one conversation run one after another: a request whose conversation is busy waits.

Every conversation has an owner (the API key its requests carry, see keys.py; "" without keys): a request is
matched, by id or by history, to its owner's conversations only, so one key can neither reach nor detect another's.

The registry also keeps the store within its `Bounds`: after each saved turn (and at start) the conversations unused
for longer than `expire_after` go, then the least recently used ones until the count and bytes fit. A conversation
with a turn under way is never removed, nor the one whose turn was just saved (however large it is alone).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from h2o_stream.errors import H2OStreamError

from .history import History
from .protocol import ApiError
from .store import CONVERSATION_ID, Bounds, Record, Store, split_id, stored_id, to_remove

log = logging.getLogger("h2o_stream.serve")


@dataclass
class Source:
    """A state to start from: `file` (None: the session in memory, or an empty cache when `empty`), the exchanges
    it covers, and the (digest, file) that will be the new turn's previous turn when nothing is replayed."""

    file: str | None
    start: int
    keep_prev: tuple[str, str] | None = None
    empty: bool = False


@dataclass
class Plan:
    """Where a request's turn goes: the conversation stored as `key` (`record` when it exists and is used in place),
    and the states to try, best first (the last is always an empty cache, so a refused file still leaves a way)."""

    key: str
    record: Record | None
    sources: list[Source]
    how: str  # "continued", "branched", "rewound", "rebuilt", "new": said to the client
    notices: list[str] = field(default_factory=list)

    @property
    def id(self) -> str:
        """The conversation's id as its client knows it (without its owner)."""
        return split_id(self.key)[1]


class Conversations:
    """The registry the model worker owns (one thread: no locks). `make_session(system, policy_settings)` builds an
    empty ChatSession; `clock()` is the time a turn is saved at, and that `bounds.expire_after` counts from."""

    def __init__(
        self, store: Store, make_session: Callable, capacity: int, bounds: Bounds | None = None, clock=time.time
    ):
        self.store, self.make_session, self.capacity = store, make_session, capacity
        self.bounds, self.clock = bounds or Bounds(), clock
        self.sessions: OrderedDict[str, object] = OrderedDict()  # id -> ChatSession, least recently used first
        self.busy: set[str] = set()
        self.heads: dict[str, set[str]] = {}
        self.prevs: dict[str, set[str]] = {}
        for record in store.records.values():
            self._index(record)

    # -- matching ------------------------------------------------------------------------------------------------------

    def plan(self, history: History, conversation: str | None, owner: str = "") -> Plan | None:
        """The plan for a request of `owner`, its conversation marked busy; None while it must wait (its conversation
        is busy). How many turns are under way at once is the worker's to bound."""
        if conversation:
            plan = self._by_id(history, stored_id(owner, conversation))
        else:
            plan = self._by_history(history, owner)
        if plan is not None:
            self.busy.add(plan.key)
        return plan

    def _by_id(self, history: History, cid: str) -> Plan | None:
        if cid in self.busy:
            return None
        record = self.store.records.get(cid)
        if record is None:
            return Plan(cid, None, [_empty()], "new")
        n, prefix = len(history.exchanges), history.prefix
        if record.turns <= n and prefix[record.turns] == record.head:
            return Plan(cid, record, self._from_head(record, n), "continued")
        if record.prev_file and record.turns - 1 <= n and prefix[record.turns - 1] == record.prev:
            keep = (record.prev, record.prev_file) if record.turns - 1 == n else None
            return Plan(cid, record, [Source(record.prev_file, record.turns - 1, keep), _empty()], "rewound")
        return Plan(cid, record, [_empty()], "rebuilt")

    def _by_history(self, history: History, owner: str) -> Plan | None:
        for p in range(len(history.exchanges), 0, -1):
            digest = history.prefix[p]
            if heads := _owned(self.heads.get(digest), owner):
                free = [i for i in heads if i not in self.busy]
                if not free:
                    return None  # the conversation is busy: wait for it, then match again
                record = max((self.store.records[i] for i in free), key=lambda r: r.updated)
                return Plan(record.id, record, self._from_head(record, len(history.exchanges)), "continued")
            if prevs := _owned(self.prevs.get(digest), owner):
                record = max((self.store.records[i] for i in prevs), key=lambda r: r.updated)
                return Plan(_new_id(owner), None, [Source(record.prev_file, p), _empty()], "branched")
        return Plan(_new_id(owner), None, [_empty()], "new")

    def _from_head(self, record: Record, n: int) -> list[Source]:
        keep = (record.head, record.file) if record.turns == n else None
        head = Source(None if record.id in self.sessions else record.file, record.turns, keep)
        sources = [head]
        if record.prev_file:
            sources.append(Source(record.prev_file, record.turns - 1))
        return sources + [_empty()]

    # -- a turn --------------------------------------------------------------------------------------------------------

    def open(self, plan: Plan, history: History, policy: dict):
        """The session to run the plan's turn on, and the source used: the first state of the plan that loads (a
        file that fails its check is put aside and reported in `plan.notices`)."""
        for source in plan.sources:
            if source.empty:
                session = self.make_session(history.system, policy)
            elif source.file is None:
                session = self.sessions[plan.key]
            else:
                session = self.make_session(None, policy)
                try:
                    session.load(self.store.path(source.file))
                except H2OStreamError as error:
                    plan.notices.append(self.store.quarantine(self.store.path(source.file), str(error)))
                    self._forget_file(source.file)
                    continue
            self.sessions[plan.key] = session
            self.sessions.move_to_end(plan.key)
            self._shrink()
            return session, source
        raise AssertionError("a plan always ends with an empty cache")

    def commit(self, plan: Plan, source: Source, session, history: History, reply: str, replayed: int) -> None:
        """Save the finished turn, `history`'s new message answered by `reply` (H2OStreamError if the disk refuses:
        then `abandon`)."""
        old = self.store.records.get(plan.key)
        generation = (old.generation if old else 0) + 1
        keep = source.keep_prev if not replayed else None
        record = Record(
            plan.key,
            root=history.prefix[0],
            turns=session.turns,
            head=history.digest_after(reply),
            file=f"{plan.key}.{generation}.session",
            generation=generation,
            prev=keep[0] if keep else None,
            prev_file=keep[1] if keep else None,
            updated=self.clock(),
        )
        self.store.commit(record, session)
        if old is not None:
            self._unindex(old)
        self._index(record)
        self.trim(spare=plan.key)
        self.busy.discard(plan.key)

    def abandon(self, plan: Plan) -> None:
        """The turn did not complete: the conversation is what its last committed file says (its session in memory,
        now ahead of that, is dropped)."""
        self.sessions.pop(plan.key, None)
        self.busy.discard(plan.key)

    # -- removal -------------------------------------------------------------------------------------------------------

    def delete(self, owner: str, name: str) -> None:
        """Remove `owner`'s conversation `name` (index, files, session in memory). ApiError 404 if `owner` has no
        such conversation (another owner's is not there for it), 409 while a turn of it is under way."""
        record = self.store.records.get(stored_id(owner, name)) if CONVERSATION_ID.fullmatch(name) else None
        if record is None:
            raise ApiError(404, f"there is no conversation {name!r}", code="conversation_not_found")
        if record.id in self.busy:
            raise ApiError(
                409,
                f"conversation {name!r} has a turn under way; delete it once the turn completes",
                code="conversation_busy",
            )
        self._remove(record)

    def trim(self, spare: str | None = None) -> int:
        """Remove what `bounds` no longer allows (see the module docstring), never a busy conversation nor `spare`;
        how many were removed (each is logged)."""
        if self.bounds == Bounds():
            return 0
        now = self.clock()
        free = [r for r in self.store.records.values() if r.id not in self.busy and r.id != spare]
        removed = 0
        for record in to_remove(free, self.store.sizes, self.bounds, now):
            try:
                self._remove(record)
            except OSError as error:
                log.warning("conversation %s could not be removed (%s)", record.id, error.strerror or error)
                continue
            removed += 1
            log.info("removed conversation %s, unused for %.0f s", record.id, now - record.updated)
        return removed

    def _remove(self, record: Record) -> None:
        self.store.remove(record)
        self._unindex(record)
        self.sessions.pop(record.id, None)

    def _shrink(self) -> None:
        idle = [i for i in self.sessions if i not in self.busy]
        while len(self.sessions) > self.capacity and idle:
            del self.sessions[idle.pop(0)]

    def _forget_file(self, name: str) -> None:
        for record in self.store.records.values():
            if record.prev_file == name:
                self._unindex(record)
                record.prev, record.prev_file = None, None
                self._index(record)

    def _index(self, record: Record) -> None:
        self.heads.setdefault(record.head, set()).add(record.id)
        if record.prev:
            self.prevs.setdefault(record.prev, set()).add(record.id)

    def _unindex(self, record: Record) -> None:
        self.heads.get(record.head, set()).discard(record.id)
        if record.prev:
            self.prevs.get(record.prev, set()).discard(record.id)


def _empty() -> Source:
    return Source(None, 0, None, empty=True)


def _new_id(owner: str) -> str:
    return stored_id(owner, uuid.uuid4().hex[:20])


def _owned(ids: set[str] | None, owner: str) -> list[str]:
    """The ids among `ids` that `owner` owns."""
    return [i for i in ids or () if split_id(i)[0] == owner]
