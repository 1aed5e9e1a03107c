"""The one model worker: a thread that owns the model, every conversation and the store, and runs turns.

Concurrency: HTTP requests are handled on the server's event loop; each turn becomes a `Job` handed to this thread.
Each turn under way runs in its own greenlet on this thread, and its forward passes run as the rows of one batch with
those of every other turn under way (continuous batching, batching.py): each round, every turn runs to its next
forward (a chunk of a replayed exchange or of the new message, or one token of the reply), then the round's forwards
run together. So replies stream side by side, a new request joins at the next round, and a decode step of eight
conversations costs little more than one (on a CPU it is bound by reading the weights). Turns of one conversation
run one after another (a request whose conversation is busy waits), and at most `max_batch` turns are under way at
once (the rest wait), which bounds memory. Events go back to the request's coroutine through its own asyncio queue.
Other work on the conversations (a delete) is a `Call`, run by this thread when it takes it from the inbox, between
two rounds: the registry stays the thread's own, with no lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import greenlet
import torch

from h2o_stream.apps.chat import chat_sampling
from h2o_stream.engine.feed import feed
from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.generation import Decoder, stop_token_ids

from .batching import Forward, run_forwards
from .conversations import Conversations, Plan, Source
from .history import History
from .protocol import FINISH_REASONS, ApiError, PromptLimit, usage
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
    limit: PromptLimit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    owner: str = ""  # whose conversations it may use (keys.owner_name of its API key; "" without keys)


@dataclass
class TextTurn:
    """A text completion a client asks for, checked: its prompt, read into a fresh cache of `policy` and kept nowhere
    (no conversation, no file), and the settings of the text that continues it."""

    prompt: str
    policy: dict
    sampling: dict  # as TurnRequest's
    limit: PromptLimit
    seed: int | None = None
    stop: tuple[str, ...] = ()
    echo: bool = False  # the prompt comes back before the text that continues it


@dataclass
class Job:
    """A turn on its way through the worker. `events` receives ("start", info), ("text", piece)...,
    then ("done", info) or ("error", ApiError); `cancel()` (from any thread) stops it."""

    request: TurnRequest | TextTurn
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finished: bool = False
    plan: Plan | None = None
    task: greenlet.greenlet | None = None  # runs the turn, suspended at each forward (batching.py)
    result: object = None  # the output of the forward it asked for (or the exception it raised), to resume it with

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

    def __init__(
        self, conversations: Conversations, model, *, max_jobs: int = 256, max_batch: int = 16, batch: bool = True
    ):
        self.conversations, self.model = conversations, model
        self.max_jobs, self.max_batch = max_jobs, max_batch
        self.batch = batch  # False: the round's forwards run one by one (as rows of a batch they equal that)
        self._inbox: queue.Queue[Job | Call] = queue.Queue()
        self._pending: deque[Job] = deque()
        self._active: deque[Job] = deque()
        self._count = 0  # jobs submitted and not finished
        self._count_lock = threading.Lock()
        self._stopping = threading.Event()
        self._halting = threading.Event()  # a graceful stop began: every job ends, new ones are refused
        self._changed = False  # a job arrived or ended since waiting jobs were last tried
        self._thread = threading.Thread(target=self._run, name="h2o-stream-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel every job (each conversation stays at its last completed turn) and end the thread."""
        self._stopping.set()
        self._thread.join(timeout=30)

    def halt(self) -> None:
        """From any thread, when a graceful stop begins: every job under way or waiting ends with a 503 error event
        (a stream ends with it, rather than being cut), its conversation at its last completed turn; new jobs are
        refused."""
        self._halting.set()

    def submit(self, request: TurnRequest | TextTurn, loop: asyncio.AbstractEventLoop) -> Job:
        if self._halting.is_set():
            raise _shutting_down()
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
                if self._halting.is_set():
                    self._end_all()
                    continue
                if self._changed or any(job.cancelled for job in self._pending):
                    self._changed = False
                    self._start_waiting()
                if self._active:
                    self._round()
            self._end_all()

    def _end_all(self) -> None:
        jobs = [*self._active, *self._pending, *self._drain()]
        self._active.clear()
        self._pending.clear()
        for job in jobs:
            self._end(job, _shutting_down())

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
            if len(self._active) >= self.max_batch:  # a cache per turn under way: memory stays bounded
                continue
            request = job.request
            if isinstance(request, TextTurn):
                self._pending.remove(job)
                self._launch(job, self._text, job, request)
                continue
            try:
                plan = self.conversations.plan(request.history, request.conversation, request.owner)
                if plan is None:
                    continue
                self._pending.remove(job)
                job.plan = plan
                # opened now, in the order planned: a file it starts from cannot be replaced by another turn first
                opened = self.conversations.open(plan, request.history, request.policy)
            except Exception as error:  # noqa: BLE001 - anything at all: this request fails, the server goes on
                if job in self._pending:
                    self._pending.remove(job)
                self._end(job, _api_error(error))
                continue
            self._launch(job, self._turn, job, request, plan, *opened)

    def _launch(self, job: Job, body, *args) -> None:
        job.task = greenlet.greenlet(lambda *_: body(*args))  # the first switch passes the (empty) result
        self._active.append(job)

    def _round(self) -> None:
        """Every turn under way runs to its next forward (or its end); then the round's forwards run, batched."""
        asked = []
        for job in list(self._active):
            forward = self._resume(job)
            if forward is not None:
                asked.append((job, forward))
        outputs = run_forwards(self.model, [forward for _, forward in asked], batch=self.batch)
        for (job, _), output in zip(asked, outputs, strict=True):
            job.result = output

    def _resume(self, job: Job) -> Forward | None:
        """Run `job` until it asks for a forward (returned) or ends (None: it is no longer under way)."""
        assert job.task is not None  # a job is only made active (by _launch) with its task
        if job.cancelled:
            self._active.remove(job)
            self._end(job, None)
            return None
        given, job.result = job.result, None
        asked = None
        try:
            asked = job.task.throw(given) if isinstance(given, BaseException) else job.task.switch(given)
        except _Cancelled:
            self._end(job, None)
        except Exception as error:  # noqa: BLE001 - the turn failed: its conversation is rolled back, others go on
            self._end(job, _api_error(error))
        else:
            if job.task.dead:
                self._finish(job)
        if job.task.dead:
            self._active.remove(job)
            return None
        return asked

    def _end(self, job: Job, error: ApiError | None) -> None:
        """Stop `job` without completing its turn: the conversation stays at its last completed turn."""
        if job.task:  # suspended at a forward: unwound there, and the session restores itself to before the turn
            try:
                job.task.throw(greenlet.GreenletExit)
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

    def _text(self, job: Job, request: TextTurn) -> None:
        """A text completion: the prompt read chunk by chunk, then the text that follows it piece by piece."""
        session = self.conversations.make_session(None, request.policy)
        ids = session.tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise ApiError(400, "the prompt holds no tokens", param="prompt")
        request.limit.check(session, len(ids), request.sampling["max_new_tokens"])
        job.emit("start", {})
        logits = feed(session.model, session.cache, torch.tensor([ids]), session.chunk_size)
        sampling = chat_sampling(**{k: v for k, v in request.sampling.items() if v is not None}, seed=request.seed)
        decoder = Decoder(
            session.model,
            session.tokenizer,
            sampling,
            stop_ids=stop_token_ids(session.tokenizer, session.model, chat_template=False),
            stop_strings=request.stop,
            strip_start=False,
        )
        if request.echo:
            job.emit("text", request.prompt)
        for text in decoder.stream(session.cache, logits, should_stop=lambda: job.cancelled):
            job.emit("text", text)
        result = decoder.result
        job.emit(
            "done",
            {
                "finish_reason": "length" if result.stop_reason == "length" else "stop",
                "usage": usage(0, len(ids), len(result.token_ids)),
            },
        )

    def _turn(self, job: Job, request: TurnRequest, plan: Plan, session, source: Source) -> None:
        """A turn: replayed exchanges, then the reply piece by piece, then the commit."""
        history = request.history
        replay = history.exchanges[source.start :]
        reused = session.cache.seen
        # before anything is read: a turn over the limits costs the server nothing (and its conversation is as it was)
        request.limit.check(session, session.prompt_size(replay, history.message), request.sampling["max_new_tokens"])
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
        settings = {k: v for k, v in request.sampling.items() if v is not None}
        session.sampling = chat_sampling(**settings, seed=session.sampling.seed)  # the seed is only recorded
        if request.seed is not None:
            session.generator.manual_seed(request.seed)
        reply = session.send(history.message, should_stop=lambda: job.cancelled, stop=request.stop)
        try:
            for piece in reply:
                job.emit("text", piece)
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


def _shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down; try again when it is back", kind="server_error")


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
