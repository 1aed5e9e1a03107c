"""An endless chat session over a fixed-size KV cache: the library the `h2o-stream chat` REPL is a thin shell over.

Each turn feeds only that turn's tokens into the cache (the chat template's rendering of the new user message, then
the reply as it is generated, then the template's end-of-message text); the history is never re-encoded, and the cache
is cut back to its budget after every forward pass, so memory stays flat however long the conversation runs.

No terminal I/O here: `ChatSession.send` yields text deltas (decoded incrementally, so a multi-byte character is
only shown once it is complete) and returns a `TurnResult`.

    session = ChatSession(model, tokenizer, policy=make_policy("h2o", 512), system="Be brief.")
    for delta in session.send("Hello!"):
        print(delta, end="", flush=True)
    session.save("chat.pt")          # cache, scores, counters, RNG state; resumed with ChatSession.load
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.engine.policies import EvictionPolicy, make_policy, policy_class
from h2o_stream.engine.feed import chunks, feed

SESSION_FORMAT = "h2o-stream chat session"
SESSION_VERSION = 1
DEFAULT_CACHE_SIZE = 512
DEFAULT_CHUNK_SIZE = 64
RECENT_MESSAGES = 6  # messages kept as text (for display after /load); the cache is what the model remembers
RECENT_CHARS = 4000  # per kept message

# Stand-in history used to render the template around a new message. Only its shape matters (a finished exchange):
# it is never fed, it just tells the template what came before.
_STAND_IN_USER = "Hello."
_STAND_IN_REPLY = "Hi."
_PROBE_TEXT = "Hello, world! 123 Ünïcode ✓"


@dataclass
class Sampling:
    """temperature 0 = greedy; top_p 1 = no nucleus cut; seed None = a random one (recorded, see `seed`)."""

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 256
    seed: int | None = None

    def __post_init__(self):
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) or \
                not self.temperature >= 0:
            raise H2OStreamError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise H2OStreamError(f"top-p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or \
                self.max_new_tokens < 1:
            raise H2OStreamError(f"max-new-tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.seed is None:
            self.seed = secrets.randbits(63)
        elif isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise H2OStreamError(f"seed must be an integer >= 0, got {self.seed!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)


@dataclass
class TurnResult:
    text: str  # the reply as decoded (special tokens skipped)
    prompt_tokens: int  # template + user tokens fed for this turn, end-of-message tokens included
    generated_tokens: int  # reply tokens sampled and kept
    stop_reason: str  # "end" (end-of-turn token / stop text), "length" (max_new_tokens), "interrupted", "cancelled"
    prompt_seconds: float
    generate_seconds: float
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens (stop token excluded)

    @property
    def tokens_per_second(self) -> float:
        """Generation speed of this turn (sampled tokens per second of decoding)."""
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0


# --- chat formats ---------------------------------------------------------------------------------------------------


class _NotIncremental(Exception):
    pass


class ChatFormat:
    """How turns become tokens: `user_ids` for a new user message (the first one also carries the system prompt),
    `closing_ids` after every reply, and what ends a reply (`stop_ids`, `stop_strings`)."""

    kind: str
    notice: str | None = None  # said to the user once (e.g. why the plain format is used)
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer, system: str | None):
        self.tokenizer = tokenizer
        self.system = system
        self.stop_ids: set[int] = _eos_ids(tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        raise NotImplementedError

    def closing_ids(self) -> list[int]:
        raise NotImplementedError

    def fingerprint(self) -> str:
        raise NotImplementedError


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template, rendered incrementally.

    A new message's text is `render(history + new, generation prompt) - render(history)`, with a stand-in history of
    the same shape (system prompt, one finished exchange): the real history is never kept or re-rendered. The
    constructor checks that the pieces (first turn, reply, closing, next turn) add up to the full rendering of the
    whole conversation, and raises `_NotIncremental` for templates where they do not.
    """

    kind = "template"

    def __init__(self, tokenizer, system: str | None):
        super().__init__(tokenizer, system)
        self._base = [{"role": "system", "content": system}] if system else []
        self._before_later_turns = self._base + [{"role": "user", "content": _STAND_IN_USER},
                                                 {"role": "assistant", "content": _STAND_IN_REPLY}]
        # The end-of-message text: the rendered reply minus (generation prompt + content).
        asked = self._base + [{"role": "user", "content": _STAND_IN_USER}]
        prompt = self._render(asked, True)
        answered = self._render(asked + [{"role": "assistant", "content": _STAND_IN_REPLY}], False)
        self._closing = _suffix(answered, prompt + _STAND_IN_REPLY, "a reply")
        self._closing_ids = self.encode(self._closing)
        if self._closing_ids:
            first = self._closing_ids[0]
            if first in set(getattr(tokenizer, "all_special_ids", ())) or \
                    tokenizer.convert_ids_to_tokens(first) in getattr(tokenizer, "added_tokens_encoder", {}):
                self.stop_ids.add(first)  # e.g. <|im_end|>: the model ends its reply with it
        self._check_adds_up()

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        if not messages:
            return ""
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as error:  # jinja errors, templates that raise on roles they do not support
            raise _NotIncremental(f"rendering it failed ({' '.join(str(error).split())[:200]})") from error
        if not isinstance(text, str):
            raise _NotIncremental("rendering it did not give text")
        return text

    def user_text(self, text: str, *, first: bool) -> str:
        before = [] if first else self._before_later_turns
        new = (self._base if first else []) + [{"role": "user", "content": text}]
        return _suffix(self._render(before + new, True), self._render(before, False), "a user message")

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        try:
            return self.encode(self.user_text(text, first=first))
        except _NotIncremental as error:
            raise H2OStreamError(f"the chat template cannot render this message: {error}") from None

    def closing_ids(self) -> list[int]:
        return list(self._closing_ids)

    def _check_adds_up(self) -> None:
        u1, a1, u2 = "What is two plus two?", "Four.", "And three plus three?"
        pieces = self.user_text(u1, first=True) + a1 + self._closing + self.user_text(u2, first=False)
        whole = self._render(self._base + [{"role": "user", "content": u1}, {"role": "assistant", "content": a1},
                                           {"role": "user", "content": u2}], True)
        if pieces != whole:
            raise _NotIncremental("its turns do not add up to the rendering of the whole conversation")

    def fingerprint(self) -> str:
        return "template:" + hashlib.sha256(str(self.tokenizer.chat_template).encode()).hexdigest()[:16]


class PlainFormat(ChatFormat):
    """For tokenizers without a (usable) chat template: `System\\n\\nUser: ...\\nAssistant: ...\\n` and so on.

    A reply ends at an end-of-sequence token or when the model starts the next "User:" line; that text has then been
    fed already and stays in the cache (harmless, and a reply never shows it).
    """

    kind = "plain"
    stop_strings = ("\nUser:",)

    def __init__(self, tokenizer, system: str | None, notice: str | None = None):
        super().__init__(tokenizer, system)
        self.notice = notice
        bos = getattr(tokenizer, "bos_token_id", None)
        self._bos = [bos] if bos is not None and bos not in self.stop_ids else []

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        prefix = f"{self.system}\n\n" if first and self.system else ""
        return (self._bos if first else []) + self.encode(f"{prefix}User: {text}\nAssistant:")

    def closing_ids(self) -> list[int]:
        return self.encode("\n")

    def fingerprint(self) -> str:
        return "plain"


def chat_format(tokenizer, system: str | None = None) -> ChatFormat:
    """The tokenizer's chat template if it has one that renders incrementally, else the plain format (with a notice
    saying why)."""
    if not getattr(tokenizer, "chat_template", None):
        return PlainFormat(tokenizer, system, "the tokenizer has no chat template; using a plain "
                                             "'User: ... / Assistant: ...' prompt format")
    try:
        return TemplateFormat(tokenizer, system)
    except _NotIncremental as error:
        return PlainFormat(tokenizer, system, f"the tokenizer's chat template cannot be used turn by turn ({error}); "
                                              "using a plain 'User: ... / Assistant: ...' prompt format")


def _suffix(whole: str, prefix: str, what: str) -> str:
    if not whole.startswith(prefix):
        raise _NotIncremental(f"rendering {what} rewrites the text before it")
    return whole[len(prefix):]


def _eos_ids(tokenizer) -> set[int]:
    ids = getattr(tokenizer, "eos_token_id", None)
    return {ids} if isinstance(ids, int) else set(ids or ())


# --- incremental decoding -------------------------------------------------------------------------------------------


class TextStream:
    """Token ids in, text out, as soon as it is final: bytes of an unfinished UTF-8 character are held back, and so
    is text that could be the start of a stop string. `push` returns (new text, stop string reached)."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to text already handed on (kept for context: spaces, merges)
        self._read = 0
        self._held = ""  # decoded but not released (possible stop string)
        self._started = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return "", False
        self._prefix, self._read = self._read, len(self.ids)
        return self._release(now[len(before):])

    def finish(self) -> str:
        """The rest, unfinished characters and all (at the end of a reply)."""
        before = self._decode(self.ids[self._prefix:self._read])
        now = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        text, _ = self._release(now[len(before):], final=True)
        return text

    def _release(self, text: str, final: bool = False) -> tuple[str, bool]:
        held = self._held + text
        for stop in self.stop_strings:
            at = held.find(stop)
            if at >= 0:
                self._held = ""
                return self._start(held[:at]), True
        keep = 0 if final else max((k for stop in self.stop_strings for k in range(1, len(stop))
                                    if held.endswith(stop[:k])), default=0)
        self._held = held[len(held) - keep:] if keep else ""
        return self._start(held[:len(held) - keep]), False

    def _start(self, text: str) -> str:
        if not self._started:  # a reply's leading whitespace (e.g. after "Assistant:") is not shown
            text = text.lstrip()
            self._started = bool(text)
        return text


# --- sampling -------------------------------------------------------------------------------------------------------


def sample_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """Greedy at temperature 0, else nucleus sampling (the smallest set of tokens whose probability reaches top_p)."""
    if sampling.temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.detach().float().cpu() / sampling.temperature, dim=-1)
    if sampling.top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p  # the top token always stays
        sorted_probs[outside] = 0
        return int(order[torch.multinomial(sorted_probs, 1, generator=generator)])
    return int(torch.multinomial(probs, 1, generator=generator))


# --- the session ----------------------------------------------------------------------------------------------------


class _Cancelled(Exception):
    pass


class ChatSession:
    """A multi-turn chat whose KV cache never grows past the policy's budget.

    `model`/`tokenizer`: a causal LM (any family StreamingCache supports) and its tokenizer; the tokenizer's chat
    template is used when it renders turn by turn, else a plain format (`notice` says so). `policy`: an
    EvictionPolicy, default h2o with a 512-entry cache. `chunk_size`: user-message tokens per forward pass.
    """

    def __init__(self, model, tokenizer, *, policy: EvictionPolicy | None = None, rolling: bool = True,
                 system: str | None = None, sampling: Sampling | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE,
                 model_name: str | None = None):
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise H2OStreamError(f"chunk size must be an integer >= 1, got {chunk_size!r}")
        if system is not None and not system.strip():
            system = None
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.chunk_size = chunk_size
        self.sampling = sampling or Sampling()
        self._format = chat_format(tokenizer, system)
        self._fingerprint = {**model_fingerprint(model), "name": self.model_name}
        self.cache = StreamingCache(model, policy if policy is not None else make_policy("h2o", DEFAULT_CACHE_SIZE),
                                    rolling=rolling)
        self._generator = torch.Generator().manual_seed(self.sampling.seed)
        self._busy = False  # a turn is under way (its generator is suspended mid-reply)
        self._reset_counters()

    # -- properties ---------------------------------------------------------------------------------------------------

    @property
    def system(self) -> str | None:
        return self._format.system

    @property
    def notice(self) -> str | None:
        """Something to tell the user once, e.g. that the plain prompt format is used and why."""
        return self._format.notice

    @property
    def format_kind(self) -> str:
        return self._format.kind

    @property
    def policy(self) -> EvictionPolicy:
        return self.cache.policy

    @property
    def budget(self) -> int | None:
        return self.cache.policy.budget

    @property
    def recent_messages(self) -> list[dict]:
        return list(self._recent)

    def _reset_counters(self) -> None:
        self.turns = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.prompt_seconds = 0.0
        self.generate_seconds = 0.0
        self.last_turn: TurnResult | None = None
        self._recent: deque[dict] = deque(maxlen=RECENT_MESSAGES)

    # -- turns --------------------------------------------------------------------------------------------------------

    def send(self, text: str, *, should_stop: Callable[[], bool] | None = None) -> Iterator[str]:
        """Add a user message and generate the reply, yielding its text as it comes; returns a TurnResult (also kept
        as `last_turn`).

        `should_stop()` is polled before every forward pass: while the message is being fed a True cancels the
        turn (the session is as before it), while the reply is generated it ends the reply there (what was said
        stays). Closing the generator early also ends the reply there. If anything raises mid-turn (even inside a
        forward pass) the session is restored to where it was before the turn.
        """
        if not isinstance(text, str):
            raise H2OStreamError(f"a message must be text, got {type(text).__name__}")
        if not text.strip():
            raise H2OStreamError("the message is empty")
        return self._turn(text, should_stop or (lambda: False))

    def chat(self, text: str, *, should_stop: Callable[[], bool] | None = None) -> TurnResult:
        """`send` without streaming: the whole turn, then its TurnResult."""
        for _ in self.send(text, should_stop=should_stop):
            pass
        return self.last_turn

    def _check_idle(self, action: str) -> None:
        if self._busy:
            raise H2OStreamError(f"cannot {action} while a reply is being generated: finish or close it first")

    def _turn(self, text: str, should_stop: Callable[[], bool]) -> Iterator[str]:
        self._check_idle("start another turn")
        self._busy = True
        try:
            return (yield from self._run_turn(text, should_stop))
        finally:
            self._busy = False

    def _run_turn(self, text: str, should_stop: Callable[[], bool]) -> Iterator[str]:
        checkpoint = self._checkpoint()
        stream = TextStream(self.tokenizer, self._format.stop_strings)
        generated: list[int] = []
        fed = 0  # generated tokens already in the cache
        reason = "length"
        prompt_seconds = generate_seconds = 0.0
        try:
            start = time.perf_counter()
            ids = torch.tensor([self._format.user_ids(text, first=self.turns == 0)], dtype=torch.long)
            logits = None
            for piece in chunks(ids, self.chunk_size):
                if should_stop():
                    raise _Cancelled
                logits = feed(self.model, self.cache, piece, self.chunk_size)
            prompt_tokens = ids.shape[1]
            prompt_seconds = time.perf_counter() - start

            start = time.perf_counter()
            for step in range(self.sampling.max_new_tokens):
                if should_stop():
                    reason = "interrupted"
                    break
                token = sample_token(logits, self.sampling, self._generator)
                if token in self._format.stop_ids:
                    reason = "end"
                    break
                generated.append(token)
                delta, stopped = stream.push(token)
                if delta:
                    generate_seconds += time.perf_counter() - start
                    yield delta
                    start = time.perf_counter()
                if stopped:
                    reason = "end"
                    break
                if step + 1 < self.sampling.max_new_tokens:
                    logits = self._step(token)
                    fed += 1
            generate_seconds += time.perf_counter() - start
            rest = stream.finish()
            if rest:
                yield rest
        except _Cancelled:
            self._restore(checkpoint)
            self.last_turn = TurnResult("", 0, 0, "cancelled", 0.0, 0.0)
            return self.last_turn
        except GeneratorExit:  # the caller stopped listening (at a yield): end the reply there, keep what was said
            self._close_turn(checkpoint, text, stream, generated, fed, prompt_tokens, "interrupted",
                             prompt_seconds, generate_seconds)
            raise
        except BaseException:
            self._restore(checkpoint)
            raise
        return self._close_turn(checkpoint, text, stream, generated, fed, prompt_tokens, reason, prompt_seconds,
                                generate_seconds)

    @torch.no_grad()
    def _step(self, token: int) -> torch.Tensor:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.model.device)
        return self.model(ids, cache=self.cache).logits[0, -1]

    def _close_turn(self, checkpoint, text, stream, generated, fed, prompt_tokens, reason, prompt_seconds,
                    generate_seconds) -> TurnResult:
        """Feed the reply's last token(s) and the end-of-message tokens, so the cache holds whole messages."""
        try:
            start = time.perf_counter()
            closing = generated[fed:] + self._format.closing_ids()
            if closing:
                feed(self.model, self.cache, torch.tensor([closing], dtype=torch.long), self.chunk_size)
            prompt_seconds += time.perf_counter() - start
        except BaseException:
            self._restore(checkpoint)
            raise
        closing_tokens = len(closing) - (len(generated) - fed)
        result = TurnResult(text=stream._decode(generated), prompt_tokens=prompt_tokens + closing_tokens,
                            generated_tokens=len(generated), stop_reason=reason, prompt_seconds=prompt_seconds,
                            generate_seconds=generate_seconds, token_ids=list(generated))
        self.turns += 1
        self.prompt_tokens += result.prompt_tokens
        self.generated_tokens += result.generated_tokens
        self.prompt_seconds += prompt_seconds
        self.generate_seconds += generate_seconds
        self._recent.append({"role": "user", "content": text[:RECENT_CHARS]})
        self._recent.append({"role": "assistant", "content": result.text[:RECENT_CHARS]})
        self.last_turn = result
        return result

    def _checkpoint(self) -> dict:
        return {"cache": self.cache.state(),  # state() copies the tensors
                "rng": self._generator.get_state(),
                "counters": self._counters(), "recent": list(self._recent), "last_turn": self.last_turn}

    def _restore(self, checkpoint: dict) -> None:
        self.cache.load_state(checkpoint["cache"])
        self._generator.set_state(checkpoint["rng"])
        self._set_counters(checkpoint["counters"])
        self._recent = deque(checkpoint["recent"], maxlen=RECENT_MESSAGES)
        self.last_turn = checkpoint["last_turn"]

    def _counters(self) -> dict:
        return {k: getattr(self, k) for k in ("turns", "prompt_tokens", "generated_tokens", "prompt_seconds",
                                              "generate_seconds")}

    def _set_counters(self, counters: dict) -> None:
        for key, value in counters.items():
            setattr(self, key, value)

    def reset(self) -> None:
        """Forget the conversation (the system prompt and settings stay; the next turn starts a new chat)."""
        self._check_idle("reset the session")
        self.cache = StreamingCache(self.model, self.cache.policy, rolling=self.cache.rolling)
        self._generator = torch.Generator().manual_seed(self.sampling.seed)
        self._reset_counters()

    # -- stats --------------------------------------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters for people and benchmarks: tokens, cache occupancy, evictions, speed, memory."""
        cache = self.cache
        slots = max(layer.slots for layer in cache.layers)
        cache_bytes = sum(t.numel() * t.element_size() for layer in cache.layers
                          for t in (layer.keys, layer.values, layer.positions, layer.scores) if t is not None)
        return {
            "turns": self.turns,
            "tokens_seen": cache.seen,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "cache_slots": slots,
            "cache_budget": cache.policy.budget,
            "policy": cache.policy.describe(),
            "evicted": cache.evicted,
            "cache_bytes": cache_bytes,
            "last_tokens_per_second": self.last_turn.tokens_per_second if self.last_turn else 0.0,
            "last_prompt_tokens_per_second": self.last_turn.prompt_tokens_per_second if self.last_turn else 0.0,
            "tokens_per_second": self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0,
            "rss_bytes": rss_bytes(),
        }

    # -- save / load --------------------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> Path:
        """Write the session (cache and scores, counters, settings, RNG state) to `path`, atomically."""
        self._check_idle("save the session")
        path = Path(path).expanduser()
        if path.is_dir():
            raise H2OStreamError(f"cannot save the session to {path}: it is a directory; give a file name")
        if not path.parent.is_dir():
            raise H2OStreamError(f"cannot save the session to {path}: the directory {path.parent} does not exist")
        state = {
            "format": SESSION_FORMAT,
            "version": SESSION_VERSION,
            "model": self._fingerprint,
            "tokenizer": tokenizer_fingerprint(self.tokenizer, self._format),
            "policy": self.cache.policy.settings(),
            "rolling": self.cache.rolling,
            "chunk_size": self.chunk_size,
            "system": self.system,
            "sampling": asdict(self.sampling),
            "rng_state": self._generator.get_state(),
            "counters": self._counters(),
            "recent": list(self._recent),
            "last_turn": asdict(self.last_turn) if self.last_turn else None,
            "cache": self.cache.state(),
            "saved_at": time.time(),
        }
        state["digest"] = _digest(state)
        partial = path.with_name(f".{path.name}.{os.getpid()}.{time.time_ns()}.tmp")
        try:
            with open(partial, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            os.replace(partial, path)
        except OSError as error:
            raise H2OStreamError(f"cannot save the session to {path}: {error.strerror or error}") from error
        finally:
            partial.unlink(missing_ok=True)
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Resume the session saved in `path`: its cache, counters, system prompt, policy and sampling settings.

        The file must come from the same model (architecture and weights) and tokenizer. On any problem this
        raises H2OStreamError and leaves this session exactly as it was.
        """
        self._check_idle("load a session")
        path = Path(path).expanduser()
        state = _read_session(path)
        try:
            fields = _check_session(state, path, self._fingerprint,
                                    tokenizer_fingerprint(self.tokenizer, self._format))
            policy = _policy_from_settings(state["policy"])
            rolling = state["rolling"]
            if not isinstance(rolling, bool):
                raise ValueError("rolling is not a bool")
            system = state["system"]
            if system is not None and not isinstance(system, str):
                raise ValueError("system is not text")
            sampling = Sampling(**state["sampling"])
            chunk_size = state["chunk_size"]
            if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
                raise ValueError("bad chunk size")
            fmt = self._format if system == self.system else chat_format(self.tokenizer, system)
            if fmt.fingerprint() != self._format.fingerprint():
                raise ValueError("the chat format changed")
            cache = StreamingCache(self.model, policy, rolling=rolling)
            _check_cache_state(state["cache"], cache, self.model)
            cache.load_state(_to_device(state["cache"], self.model.device))
            generator = torch.Generator()
            generator.set_state(state["rng_state"])
            counters = fields["counters"]
            recent = deque(({"role": str(m["role"]), "content": str(m["content"])} for m in state["recent"]),
                           maxlen=RECENT_MESSAGES)
            last_turn = TurnResult(**state["last_turn"]) if state["last_turn"] else None
        except H2OStreamError:
            raise
        except Exception as error:
            raise H2OStreamError(f"{path} is not a usable chat session (corrupt or from an incompatible "
                                 f"h2o-stream): {one_line(error)}") from error
        # Everything checked: switch over (nothing below can fail).
        self.cache, self._format, self.sampling, self.chunk_size = cache, fmt, sampling, chunk_size
        self._generator = generator
        self._set_counters(counters)
        self._recent = recent
        self.last_turn = last_turn


# --- helpers --------------------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    """Resident memory of this process (psutil), or 0 where it cannot be read."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:
        return 0


def model_fingerprint(model) -> dict:
    """What a saved cache depends on: architecture, dtype and (a digest of) the weights."""
    config = model.config.get_text_config(decoder=True)
    embedding = model.get_input_embeddings().weight.detach()
    rows = torch.cat([embedding[:32], embedding[-32:]]).to("cpu", torch.float32).contiguous()
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "dtype": str(embedding.dtype).removeprefix("torch."),
        "weights": hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16],
        "name": getattr(model.config, "_name_or_path", "") or type(model).__name__,
    }


def tokenizer_fingerprint(tokenizer, fmt: ChatFormat) -> dict:
    return {"vocab": len(tokenizer), "probe": fmt.encode(_PROBE_TEXT), "format": fmt.fingerprint()}


def _describe_model(fp: dict) -> str:
    return (f"{fp.get('name') or '?'} ({fp.get('model_type')}, {fp.get('num_hidden_layers')} layers, hidden "
            f"{fp.get('hidden_size')}, vocab {fp.get('vocab_size')}, {fp.get('dtype')})")


def _read_session(path: Path) -> dict:
    if not path.exists():
        raise H2OStreamError(f"no session file at {path}")
    if not path.is_file():
        raise H2OStreamError(f"{path} is not a session file (it is a directory)")
    try:
        # weights_only: a session file is plain data (tensors, numbers, text); nothing in it gets executed.
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # torch's own message is about pickles and weights_only, which would mislead here
        raise H2OStreamError(f"{path} is not a readable chat session: the file is corrupt or truncated, or was not "
                             "written by h2o-stream chat's /save") from None
    if not isinstance(state, dict) or state.get("format") != SESSION_FORMAT:
        raise H2OStreamError(f"{path} is not an h2o-stream chat session")
    if state.get("version") == SESSION_VERSION:
        try:
            intact = state.get("digest") == _digest({k: v for k, v in state.items() if k != "digest"})
        except Exception:
            intact = False
        if not intact:
            # torch's zip reader does not check the tensors' bytes; the digest does
            raise H2OStreamError(f"{path} is a damaged chat session (its contents do not match their checksum)")
    return state


def _digest(value) -> str:
    """sha256 over everything in a session (tensors by dtype, shape and bytes), in a fixed order."""
    digest = hashlib.sha256()

    def walk(item):
        if isinstance(item, torch.Tensor):
            tensor = item.detach().to("cpu").contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
        elif isinstance(item, dict):
            digest.update(b"{")
            for key in sorted(item, key=repr):
                digest.update(repr(key).encode())
                walk(item[key])
            digest.update(b"}")
        elif isinstance(item, (list, tuple)):
            digest.update(b"[")
            for element in item:
                walk(element)
            digest.update(b"]")
        else:
            digest.update(repr(item).encode())

    walk(value)
    return digest.hexdigest()


def _check_session(state: dict, path: Path, model_fp: dict, tokenizer_fp: dict) -> dict:
    version = state.get("version")
    if version != SESSION_VERSION:
        raise H2OStreamError(f"{path} is a chat session of format version {version}; this h2o-stream reads version "
                             f"{SESSION_VERSION}")
    saved = state["model"]
    if not isinstance(saved, dict):
        raise ValueError("no model fingerprint")
    if {k: v for k, v in saved.items() if k != "name"} != {k: v for k, v in model_fp.items() if k != "name"}:
        same_architecture = all(saved.get(k) == model_fp.get(k) for k in model_fp
                                if k not in ("name", "dtype", "weights"))
        if same_architecture and saved.get("dtype") != model_fp["dtype"]:
            raise H2OStreamError(f"{path} was saved with dtype {saved.get('dtype')}, this session runs "
                                 f"{model_fp['dtype']}: start the chat with --dtype {saved.get('dtype')} to resume it")
        raise H2OStreamError(f"{path} was saved with another model, {_describe_model(saved)}; this session runs "
                             f"{_describe_model(model_fp)}. Start the chat with that model to resume it")
    if state["tokenizer"] != tokenizer_fp:
        what = "chat format" if isinstance(state["tokenizer"], dict) and \
            state["tokenizer"].get("format") != tokenizer_fp["format"] else "tokenizer"
        raise H2OStreamError(f"{path} was saved with a different {what} for this model; it cannot be resumed here")
    counters = state["counters"]
    expected = {"turns": int, "prompt_tokens": int, "generated_tokens": int, "prompt_seconds": float,
                "generate_seconds": float}
    if set(counters) != set(expected) or not all(isinstance(counters[k], t) and not isinstance(counters[k], bool)
                                                 for k, t in expected.items()):
        raise ValueError("bad counters")
    if any(counters[k] < 0 for k in counters):
        raise ValueError("negative counters")
    return {"counters": counters}


def _policy_from_settings(settings: dict) -> EvictionPolicy:
    settings = dict(settings)
    return policy_class(settings.pop("policy"))(**settings)


_LAYER_KEYS = {"keys", "values", "positions", "scores", "seen", "evicted"}


def _check_cache_state(state: dict, cache: StreamingCache, model) -> None:
    """Shapes, dtypes and bookkeeping of a saved cache, against the model it is to be used with."""
    layers = state["layers"]
    if not isinstance(layers, list) or len(layers) != len(cache.layers):
        raise ValueError(f"the cache has {len(layers) if isinstance(layers, list) else '?'} layers, the model "
                         f"{len(cache.layers)}")
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype = model.get_input_embeddings().weight.dtype
    budget = cache.policy.budget
    shapes = set()
    for layer in layers:
        if not isinstance(layer, dict) or set(layer) != _LAYER_KEYS:
            raise ValueError("a layer has unexpected fields")
        seen, evicted = layer["seen"], layer["evicted"]
        if not (isinstance(seen, int) and isinstance(evicted, int) and seen >= 0 and evicted >= 0):
            raise ValueError("bad layer counters")
        keys, values, positions, scores = (layer[k] for k in ("keys", "values", "positions", "scores"))
        if keys is None:
            if seen or any(t is not None for t in (values, positions, scores)):
                raise ValueError("an empty layer with entries")
            shapes.add((0, seen))
            continue
        if not all(isinstance(t, torch.Tensor) for t in (keys, values, positions, scores)):
            raise ValueError("a layer's entries are not tensors")
        n = keys.shape[2] if keys.dim() == 4 else -1
        if keys.dim() != 4 or keys.shape[:2] != (1, kv_heads) or values.dim() != 4 or values.shape[:3] != keys.shape[:3]:
            raise ValueError(f"cache tensors of shape {tuple(keys.shape)} do not fit this model")
        if positions.shape != keys.shape[:3] or scores.shape != keys.shape[:3] or positions.dtype != torch.long \
                or not scores.is_floating_point():
            raise ValueError("cache bookkeeping does not match its entries")
        if keys.dtype != dtype or values.dtype != dtype:
            raise ValueError(f"cache tensors are {keys.dtype}, the model runs {dtype}")
        if (budget is not None and n > budget) or n > seen:
            raise ValueError(f"a layer holds {n} entries (budget {budget}, {seen} seen)")
        shapes.add((n, seen))
    if len(shapes) > 1:
        raise ValueError("layers disagree on their entries")


def _to_device(state: dict, device) -> dict:
    return {**state, "layers": [{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
                                for layer in state["layers"]]}
