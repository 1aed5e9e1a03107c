"""An endless chat session over a fixed-size KV cache: the library the `h2o-stream chat` REPL is a thin shell over.

Each turn feeds only that turn's tokens into the cache (the chat format's tokens for the new user message, then
the reply as it is generated, then the end-of-message tokens); the history is never re-encoded, and the cache is cut
back to its budget after every forward pass, so memory stays flat however long the conversation runs. Replies come
from the shared decode loop (`h2o_stream.generation`).

No terminal I/O here: `ChatSession.send` yields text as it becomes final and returns a `TurnResult`.

    session = ChatSession(model, tokenizer, policy=make_policy("h2o", 512), system="Be brief.")
    for delta in session.send("Hello!"):
        print(delta, end="", flush=True)
    session.save("chat.pt")          # cache, scores, counters, RNG state; resumed with ChatSession.load
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict
from pathlib import Path

import torch

from h2o_stream.engine.feed import chunks, feed
from h2o_stream.engine.policies import EvictionPolicy, make_policy
from h2o_stream.errors import H2OStreamError
from h2o_stream.generation import Decoder, Generation, Sampling, stop_token_ids

from . import session_file
from .defaults import CHAT_SAMPLING, DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE
from .formats import ChatFormat, chat_format
from .session_file import RECENT_MESSAGES, model_fingerprint, new_cache
from .stats import TurnResult, session_stats

RECENT_CHARS = 4000  # per kept message
_TURN_REASON = {"eos": "end", "length": "length", "cancelled": "interrupted"}  # Generation's -> TurnResult's


def chat_sampling(**settings) -> Sampling:
    """`CHAT_SAMPLING` with `settings` (e.g. seed=1) instead of the defaults they name."""
    return Sampling(**{**CHAT_SAMPLING, **settings})


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise H2OStreamError(f"chunk size must be an integer >= 1, got {chunk_size!r}")


class _Cancelled(Exception):
    pass


def _check_message(text) -> None:
    """A user message must be non-empty text that can be written as UTF-8."""
    if not isinstance(text, str):
        raise H2OStreamError(f"a message must be text, got {type(text).__name__}")
    if not text.strip():
        raise H2OStreamError("the message is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:  # lone surrogates: bytes that were not UTF-8, decoded with surrogateescape
        raise H2OStreamError(
            f"the message is not valid text (character {error.start} is not UTF-8: {text[error.start]!r})"
        ) from None


class ChatSession:
    """A multi-turn chat whose KV cache never grows past the policy's budget.

    `model`/`tokenizer`: a causal LM (any family StreamingCache supports) and its tokenizer; the tokenizer's chat
    template is used when it renders turn by turn, else a plain format (`notice` says so). `policy`: an
    EvictionPolicy, default h2o with a 512-entry cache. `sampling`: default `chat_sampling()` (a random seed).
    `chunk_size`: user-message tokens per forward pass.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        policy: EvictionPolicy | None = None,
        rolling: bool = True,
        system: str | None = None,
        sampling: Sampling | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        model_name: str | None = None,
    ):
        _check_chunk_size(chunk_size)
        if system is not None and not system.strip():
            system = None
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.chunk_size = chunk_size
        self.sampling = sampling or chat_sampling()
        self.format: ChatFormat = chat_format(tokenizer, system)
        self.fingerprint = {**model_fingerprint(model), "name": self.model_name}
        self.cache = new_cache(model, policy if policy is not None else make_policy("h2o", DEFAULT_CACHE_SIZE), rolling)
        self.generator = self.sampling.new_generator()
        self._busy = False  # a turn is under way (its generator is suspended mid-reply)
        self._reset_counters()

    @property
    def system(self) -> str | None:
        return self.format.system

    @property
    def notice(self) -> str | None:
        """Something to tell the user once, e.g. that the plain prompt format is used and why."""
        return self.format.notice

    @property
    def system_warning(self) -> str | None:
        """A warning when the system prompt alone is longer than the cache: the model cannot see all of it."""
        budget = self.budget
        if self.system is None or budget is None:
            return None
        length = len(self.format.encode(self.system))
        if length <= budget:
            return None
        return (
            f"the system prompt is {length} tokens, more than the cache holds ({budget} entries): the model "
            "cannot see all of it; shorten it or use a larger cache (--cache-size)"
        )

    @property
    def format_kind(self) -> str:
        return self.format.kind

    @property
    def policy(self) -> EvictionPolicy:
        return self.cache.policy

    @property
    def budget(self) -> int | None:
        return self.cache.policy.budget

    @property
    def recent_messages(self) -> list[dict]:
        """The last few messages as text (the cache, not this, is what the model remembers)."""
        return list(self._recent)

    @property
    def stop_ids(self) -> set[int]:
        """Tokens that end a reply: the format's (eos, the template's end-of-turn) and the model's eos."""
        return self.format.stop_ids | stop_token_ids(self.tokenizer, self.model, chat_template=False)

    def _reset_counters(self) -> None:
        self.turns = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prompt_seconds = 0.0
        self.generate_seconds = 0.0
        self.last_turn: TurnResult | None = None
        self._recent: deque[dict] = deque(maxlen=RECENT_MESSAGES)

    def counters(self) -> dict:
        """The session's running totals (saved with it)."""
        return {
            k: getattr(self, k)
            for k in ("turns", "prompt_tokens", "generated_tokens", "prompt_seconds", "generate_seconds")
        }

    def _set_counters(self, counters: dict) -> None:
        for key, value in counters.items():
            setattr(self, key, value)

    # -- turns --------------------------------------------------------------------------------------------------------

    def send(
        self, text: str, *, should_stop: Callable[[], bool] | None = None, stop: Sequence[str] = ()
    ) -> Iterator[str]:
        """Add a user message and generate the reply, yielding its text as it comes; returns a TurnResult (also kept
        as `last_turn`).

        `should_stop()` is polled before every forward pass: while the message is being fed a True cancels the
        turn (the session is as before it), while the reply is generated it ends the reply there (what was said
        stays). Closing the generator early also ends the reply there. If anything raises mid-turn (even inside a
        forward pass) the session is restored to where it was before the turn. `stop`: texts that end this reply
        besides the format's own (the reply is cut before them).
        """
        _check_message(text)
        stop = tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise H2OStreamError("a stop text must be a non-empty string")
        return self._turn(text, should_stop or (lambda: False), stop)

    def replay(self, text: str, reply: str) -> TurnResult:
        """Feed a finished exchange as it was (a user message and the reply it got), generating nothing: how a
        conversation held elsewhere (a client's history) is rebuilt turn by turn. The cache then holds both
        messages, as after a turn that said `reply`; on any error the session is as before."""
        _check_message(text)
        if not isinstance(reply, str):
            raise H2OStreamError(f"a reply must be text, got {type(reply).__name__}")
        self._check_idle("replay a turn")
        checkpoint = self._checkpoint()
        try:
            start = time.perf_counter()
            ids = self._exchange_ids(text, reply, first=self.turns == 0)
            feed(self.model, self.cache, torch.tensor([ids], dtype=torch.long), self.chunk_size)
            seconds = time.perf_counter() - start
        except BaseException:
            self._restore(checkpoint)
            raise
        return self._record(
            text,
            TurnResult(
                text=reply,
                prompt_tokens=len(ids),
                generated_tokens=0,
                stop_reason="replayed",
                prompt_seconds=seconds,
                generate_seconds=0.0,
            ),
        )

    def _exchange_ids(self, text: str, reply: str, *, first: bool) -> list[int]:
        return self.format.user_ids(text, first=first) + self.format.encode(reply) + self.format.closing_ids()

    def prompt_size(self, exchanges: Sequence[tuple[str, str]], text: str) -> int:
        """How many tokens replaying `exchanges` and then reading the message `text` would feed (before a reply):
        what a turn costs before it starts."""
        size, first = 0, self.turns == 0
        for user, reply in exchanges:
            size += len(self._exchange_ids(user, reply, first=first))
            first = False
        return size + len(self.format.user_ids(text, first=first))

    def chat(self, text: str, *, should_stop: Callable[[], bool] | None = None, stop: Sequence[str] = ()) -> TurnResult:
        """`send` without streaming: the whole turn, then its TurnResult."""
        for _ in self.send(text, should_stop=should_stop, stop=stop):
            pass
        assert self.last_turn is not None  # every turn that ends without raising sets it
        return self.last_turn

    def _check_idle(self, action: str) -> None:
        if self._busy:
            raise H2OStreamError(f"cannot {action} while a reply is being generated: finish or close it first")

    def _turn(
        self, text: str, should_stop: Callable[[], bool], stop: tuple[str, ...]
    ) -> Generator[str, None, TurnResult]:
        self._check_idle("start another turn")
        self._busy = True
        try:
            return (yield from self._run_turn(text, should_stop, stop))
        finally:
            self._busy = False

    def _run_turn(
        self, text: str, should_stop: Callable[[], bool], stop: tuple[str, ...]
    ) -> Generator[str, None, TurnResult]:
        checkpoint = self._checkpoint()
        decoder = Decoder(
            self.model,
            self.tokenizer,
            self.sampling,
            stop_ids=self.stop_ids,
            generator=self.generator,
            stop_strings=self.format.stop_strings + stop,
        )
        prompt_tokens, prompt_seconds = 0, 0.0
        try:
            start = time.perf_counter()
            ids = torch.tensor([self.format.user_ids(text, first=self.turns == 0)], dtype=torch.long)
            for piece in chunks(ids, self.chunk_size):
                if should_stop():
                    raise _Cancelled
                logits = feed(self.model, self.cache, piece, self.chunk_size)
            prompt_tokens, prompt_seconds = ids.shape[1], time.perf_counter() - start
            reply = yield from decoder.stream(self.cache, logits, should_stop=should_stop)
        except _Cancelled:
            self._restore(checkpoint)
            self.last_turn = TurnResult("", 0, 0, "cancelled", 0.0, 0.0)
            return self.last_turn
        except GeneratorExit:  # the caller stopped listening (at a yield): end the reply there, keep what was said
            self._close_turn(checkpoint, text, decoder.result, "interrupted", prompt_tokens, prompt_seconds)
            raise
        except BaseException:
            self._restore(checkpoint)
            raise
        return self._close_turn(checkpoint, text, reply, _TURN_REASON[reply.stop_reason], prompt_tokens, prompt_seconds)

    def _close_turn(
        self, checkpoint: dict, text: str, reply: Generation, reason: str, prompt_tokens: int, prompt_seconds: float
    ) -> TurnResult:
        """Feed the reply's unfed last token and the end-of-message tokens, so the cache holds whole messages."""
        closing_ids = self.format.closing_ids()
        try:
            start = time.perf_counter()
            closing = reply.token_ids[reply.fed :] + closing_ids
            if closing:
                feed(self.model, self.cache, torch.tensor([closing], dtype=torch.long), self.chunk_size)
            prompt_seconds += time.perf_counter() - start
        except BaseException:
            self._restore(checkpoint)
            raise
        return self._record(
            text,
            TurnResult(
                text=reply.text,
                prompt_tokens=prompt_tokens + len(closing_ids),
                generated_tokens=len(reply.token_ids),
                stop_reason=reason,
                prompt_seconds=prompt_seconds,
                generate_seconds=reply.seconds,
                token_ids=list(reply.token_ids),
            ),
        )

    def _record(self, text: str, result: TurnResult) -> TurnResult:
        """Count a finished turn and keep its messages as text."""
        self.turns += 1
        self.prompt_tokens += result.prompt_tokens
        self.generated_tokens += result.generated_tokens
        self.prompt_seconds += result.prompt_seconds
        self.generate_seconds += result.generate_seconds
        self._recent.append({"role": "user", "content": text[:RECENT_CHARS]})
        self._recent.append({"role": "assistant", "content": result.text[:RECENT_CHARS]})
        self.last_turn = result
        return result

    def _checkpoint(self) -> dict:
        return {
            "cache": self.cache.state(),  # state() copies the tensors
            "rng": self.generator.get_state(),
            "counters": self.counters(),
            "recent": list(self._recent),
            "last_turn": self.last_turn,
        }

    def _restore(self, checkpoint: dict) -> None:
        self.cache.load_state(checkpoint["cache"])
        self.generator.set_state(checkpoint["rng"])
        self._set_counters(checkpoint["counters"])
        self._recent = deque(checkpoint["recent"], maxlen=RECENT_MESSAGES)
        self.last_turn = checkpoint["last_turn"]

    def reset(self) -> None:
        """Forget the conversation (the system prompt and settings stay; the next turn starts a new chat)."""
        self._check_idle("reset the session")
        self.cache = new_cache(self.model, self.cache.policy, self.cache.rolling)
        self.generator = self.sampling.new_generator()
        self._reset_counters()

    def change_settings(self, *, chunk_size: int | None = None, **sampling) -> None:
        """Change what a session can change without touching its cache: the chunk size and the sampling settings
        (`Sampling`'s fields by name; a new seed starts the random stream afresh from it). All are checked first: on
        an error nothing changes. The cache (policy, size, rolling) and the system prompt, which is in the cache,
        stay as they are."""
        self._check_idle("change the settings")
        if chunk_size is not None:
            _check_chunk_size(chunk_size)
        new = Sampling(**{**asdict(self.sampling), **sampling})
        if chunk_size is not None:
            self.chunk_size = chunk_size
        self.sampling = new
        if "seed" in sampling:
            self.generator = new.new_generator()

    def stats(self) -> dict:
        """Counters for people and benchmarks: tokens, cache occupancy, evictions, speed, memory."""
        return session_stats(self)

    # -- save / load --------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike, *, force: bool = False) -> Path:
        """Write the session (cache and scores, counters, settings, RNG state) to `path`, atomically. A file there
        is replaced if it is a chat session; anything else (a user's file, another kind of h2o-stream file) only
        with `force`, else `session_file.NotReplaced`."""
        self._check_idle("save the session")
        return session_file.save(self, path, force=force)

    def load(self, path: str | os.PathLike) -> None:
        """Resume the session saved in `path`: its cache, counters, system prompt, policy and sampling settings.

        The file must come from the same model (architecture and weights) and tokenizer. On any problem this
        raises H2OStreamError and leaves this session exactly as it was.
        """
        self._check_idle("load a session")
        resumed = session_file.load(self, path)
        # Everything checked: switch over (nothing below can fail).
        self.cache, self.format, self.sampling = resumed.cache, resumed.format, resumed.sampling
        self.chunk_size, self.generator = resumed.chunk_size, resumed.generator
        self._set_counters(resumed.counters)
        self._recent = resumed.recent
        self.last_turn = resumed.last_turn
