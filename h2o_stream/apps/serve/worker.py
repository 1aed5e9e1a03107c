"""The one model worker: a thread that owns the model, every conversation and the store, and runs turns.

Concurrency: HTTP requests are handled on the server's event loop; each turn becomes a `Job` handed to this thread.
The worker interleaves the turns under way round-robin, one step each (a replayed exchange, the new message, or one
piece of the reply, i.e. about one token), so replies stream side by side and a new request starts within one step
of every other; the forward passes themselves run one at a time on torch's threads (--threads). Turns of one
conversation run one after another (a request whose conversation is busy waits), and at most `capacity`
conversations are under way at once (the rest wait), which bounds memory. Events go back to the request's coroutine
through its own asyncio queue. Other work on the conversations (a delete) is a `Call`, run by this thread when it
takes it from the inbox, between two steps: the registry stays the thread's own, with no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from h2o_stream.apps.chat import chat_sampling
from h2o_stream.errors import H2OStreamError, one_line

from .conversations import Conversations, Plan, Source
from .history import History
from .protocol import FINISH_REASONS, ApiError, usage
from .store import NotSaved

log = logging.getLogger("h2o_stream.serve")


class _Cancelled(Exception):
    """The turn was cancelled while its message was read: nothing to commit."""


@dataclass
class TurnRequest:
    """One turn a client asks for, checked: its history, settings, and (optionally) the conversation it names."""

    history: History
    conversation: str | None
    policy: dict  # the cache of a conversation this turn starts (settings(); an existing one keeps its own)
    sampling: dict  # Sampling fields: temperature, top_p, top_k, repetition_penalty, max_new_tokens
    seed: int | None = None
    stop: tuple[str, ...] = ()
    owner: str = ""  # whose conversations it may use (keys.owner_name of its API key; "" without keys)


@dataclass
class Job:
    """A turn on its way through the worker. `events` receives ("start", info), ("text", piece)...,
    then ("done", info) or ("error", ApiError); `cancel()` (from any thread) stops it."""

    request: TurnRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False
    plan: Plan | None = None
    steps: Generator[None, None, None] | None = None  # the generator running the turn

    def cancel(self) -> None:
        self.cancelled = True

    def emit(self, kind: str, value=None) -> None:
        if kind in ("done", "error"):
            self.finished = True
        with contextlib.suppress(RuntimeError):  # the event loop is gone (shutting down): nobody is listening
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass
class Call:
    """Work on the conversations for the worker thread: `fn(conversations)`, its result or exception in `future`."""

    fn: Callable[[Conversations], object]
    future: Future = field(default_factory=Future)

    def run(self, conversations: Conversations) -> None:
        try:
            self.future.set_result(self.fn(conversations))
        except Exception as error:  # noqa: BLE001 - the caller's to handle (e.g. an ApiError for its client)
            self.future.set_exception(error)


class Worker:
    """The model worker thread (see the module docstring). `max_jobs` bounds the requests waiting or under way."""

    def __init__(self, conversations: Conversations, *, max_jobs: int = 256):
        self.conversations = conversations
        self.max_jobs = max_jobs
        self._inbox: queue.Queue[Job | Call] = queue.Queue()
        self._pending: deque[Job] = deque()
        self._active: deque[Job] = deque()
        self._count = 0  # jobs submitted and not finished
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._changed = False  # a job arrived or ended since waiting jobs were last tried
        self._thread = threading.Thread(target=self._run, name="h2o-stream-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job (each conversation stays at its last completed turn) and end the thread."""
        self._stopping.set()
        self._thread.join(timeout=30)

    def submit(self, request: TurnRequest, loop: asyncio.AbstractEventLoop) -> Job:
        with self._count_lock:
            if self._count >= self.max_jobs:
                raise ApiError(
                    429,
                    f"the server has {self._count} requests waiting or under way, its limit "
                    f"(h2o-stream serve --max-queue); try again shortly",
                    kind="rate_limit_error",
                    code="server_busy",
                )
            self._count += 1
        job = Job(request, loop)
        self._inbox.put(job)
        return job

    def call(self, fn: Callable[[Conversations], object]) -> Future:
        """Run `fn(conversations)` on the worker thread (within a step of now); its result in the future."""
        call = Call(fn)
        self._inbox.put(call)
        return call.future

    # -- the thread ----------------------------------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.no_grad():
            while not self._stopping.is_set():
                self._take(block=not self._active)
                if self._changed or any(job.cancelled for job in self._pending):
                    self._changed = False
                    self._start_waiting()
                if self._active:
                    self._step(self._active.popleft())
            for job in [*self._active, *self._pending, *self._drain()]:
                self._end(job, ApiError(503, "the server is shutting down", kind="server_error"))

    def _take(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.2) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._pending.extend(self._drain(item))
        self._changed = True

    def _drain(self, *taken: Job | Call) -> list[Job]:
        """The jobs among `taken` and in the inbox; each Call met is run now."""
        jobs: list[Job] = []
        items = list(taken)
        while True:
            for item in items:
                if isinstance(item, Call):
                    item.run(self.conversations)
                else:
                    jobs.append(item)
            try:
                items = [self._inbox.get_nowait()]
            except queue.Empty:
                return jobs

    def _start_waiting(self) -> None:
        """Start every waiting job whose conversation is free, in arrival order."""
        for job in list(self._pending):
            if job.cancelled:
                self._pending.remove(job)
                self._finish(job)
                continue
            try:
                plan = self.conversations.plan(job.request.history, job.request.conversation, job.request.owner)
                if plan is None:
                    continue
                self._pending.remove(job)
                job.plan = plan
                # opened now, in the order planned: a file it starts from cannot be replaced by another turn first
                opened = self.conversations.open(plan, job.request.history, job.request.policy)
            except Exception as error:  # noqa: BLE001 - anything at all: this request fails, the server goes on
                if job in self._pending:
                    self._pending.remove(job)
                self._end(job, _api_error(error))
                continue
            job.steps = self._turn(job, plan, *opened)
            self._active.append(job)

    def _step(self, job: Job) -> None:
        if job.cancelled:
            self._end(job, None)
            return
        assert job.steps is not None  # a job is only made active (by _start_waiting) with its steps set
        try:
            next(job.steps)
        except StopIteration:
            self._finish(job)
            return
        except _Cancelled:
            self._end(job, None)
            return
        except Exception as error:  # noqa: BLE001 - the turn failed: its conversation is rolled back, others go on
            self._end(job, _api_error(error))
            return
        self._active.append(job)

    def _end(self, job: Job, error: ApiError | None) -> None:
        """Stop `job` without completing its turn: the conversation stays at its last completed turn."""
        if job.steps is not None:
            try:
                job.steps.close()  # ends a reply under way (GeneratorExit inside the session's turn)
            except Exception as failure:  # noqa: BLE001 - the session is dropped below anyway; the worker goes on
                log.warning("closing a turn failed: %s", one_line(failure))
        if job.plan is not None:
            self.conversations.abandon(job.plan)
        if error is not None:
            if error.status >= 500:
                log.warning("a turn failed: %s", error.message)
            job.emit("error", error)
        self._finish(job)

    def _finish(self, job: Job) -> None:
        job.finished = True
        self._changed = True  # its conversation (and a turn slot) may be free for a waiting job
        with self._count_lock:
            self._count -= 1

    def _turn(self, job: Job, plan: Plan, session, source: Source) -> Generator[None, None, None]:
        """The turn's steps, as a generator: replayed exchanges, then the reply piece by piece, then the commit."""
        request = job.request
        history = request.history
        replay = history.exchanges[source.start :]
        reused = session.cache.seen
        job.emit(
            "start",
            {
                "conversation": plan.id,
                "how": plan.how,
                "reused_turns": source.start,
                "replayed_turns": len(replay),
                "notices": list(plan.notices),
            },
        )
        fed = 0
        for user, reply in replay:
            fed += session.replay(user, reply).prompt_tokens
            yield
        settings = {k: v for k, v in request.sampling.items() if v is not None}
        session.sampling = chat_sampling(**settings, seed=session.sampling.seed)  # the seed is only recorded
        if request.seed is not None:
            session.generator.manual_seed(request.seed)
        reply = session.send(history.message, should_stop=lambda: job.cancelled, stop=request.stop)
        try:
            for piece in reply:
                job.emit("text", piece)
                yield
        finally:
            reply.close()  # cancelled mid-reply: the session ends the reply (and is then dropped, see _end)
        result = session.last_turn
        if result.stop_reason not in FINISH_REASONS:  # cancelled while the message was read
            raise _Cancelled
        self.conversations.commit(plan, source, session, history, result.text, len(replay))
        fed += result.prompt_tokens
        stats = session.stats()
        job.emit(
            "done",
            {
                "text": result.text,
                "finish_reason": FINISH_REASONS[result.stop_reason],
                "usage": usage(reused, fed, result.generated_tokens),
                "extra": {
                    "conversation": plan.id,
                    "how": plan.how,
                    "reused_turns": source.start,
                    "replayed_turns": len(replay),
                    "fed_tokens": fed,
                    "turns": session.turns,
                    "tokens_seen": stats["tokens_seen"],
                    "cache_slots": stats["cache_slots"],
                    "cache_budget": stats["cache_budget"],
                    "policy": stats["policy"],
                    "notices": list(plan.notices),
                },
            },
        )


def _api_error(error: Exception) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, NotSaved):
        return ApiError(507, str(error), kind="server_error", code="insufficient_storage")
    if isinstance(error, H2OStreamError):
        return ApiError(400, str(error))
    return ApiError(
        500,
        f"the turn failed: {type(error).__name__}: {one_line(error)}; the conversation stays at its "
        "last completed turn",
        kind="server_error",
    )
