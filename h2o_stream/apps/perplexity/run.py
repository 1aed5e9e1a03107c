"""Streaming perplexity: every token after the stream's first is predicted once, from the state before it.

`PerplexityRun` is the state machine (cache, accumulated NLL, the pending prediction, the stream position); it can be
checkpointed at any chunk boundary and resumed with bit-identical results, because nothing in it is random and the
chunk boundaries are a function of the stream position alone. A checkpoint is only ever taken at a chunk boundary
of the uninterrupted run (never after a last chunk that --tokens cut short), and it carries a digest of the tokens fed
(`digest.StreamDigest`) so that a resume can check it continues the same stream. Checkpoints are verified files
(`h2o_stream.files`): checked against their digest and read as plain data, never as code.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import psutil
import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.engine.policies import EvictionPolicy, make_policy
from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.files import UnverifiedFile, read_verified, write_verified

from .digest import StreamDigest
from .stream import feed_stream, forward_span, token_nll, token_pieces

CHECKPOINT_KIND = "h2o-stream perplexity checkpoint"
CHECKPOINT_VERSION = 2  # 1: unverified torch pickles (refused: they could run code)


@dataclass
class PerplexityResult:
    settings: dict
    tokens_fed: int
    predicted: int
    nll_sum: float
    curve: list[tuple[int, float]]
    seconds: float
    peak_rss_bytes: int
    rss_samples: list[tuple[int, int]] = field(default_factory=list)
    process_starts: list[int] = field(default_factory=list)  # where each process of the run began (see PerplexityRun)
    max_keys_seen: int = 0  # the most keys any query attended to (budget + 1 in exact and fair chunked mode)
    span: int | None = None  # tokens per model forward (a multiple of the chunk size; None: not recorded)
    kv_entries: int | None = None  # entries per KV head held at the end, summed over all layers (sliding ones too)

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.predicted if self.predicted else float("nan")

    @property
    def ppl(self) -> float:
        return math.exp(self.mean_nll)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_fed / self.seconds if self.seconds else float("nan")

    def to_json(self) -> dict:
        return {
            "settings": self.settings,
            "tokens_fed": self.tokens_fed,
            "predicted_tokens": self.predicted,
            "nll_sum": self.nll_sum,
            "mean_nll": self.mean_nll,
            "ppl": self.ppl,
            "seconds": self.seconds,
            "tokens_per_second": self.tokens_per_second,
            "peak_rss_bytes": self.peak_rss_bytes,
            "rss_samples": self.rss_samples,
            "process_starts": self.process_starts,
            "max_keys_seen": self.max_keys_seen,
            "span": self.span,
            "kv_entries": self.kv_entries,
            "curve": self.curve,
        }


class PerplexityRun:
    """Feeds a token stream through a StreamingCache in chunks and accumulates the NLL of every prediction."""

    def __init__(
        self,
        model,
        policy: EvictionPolicy,
        *,
        chunk_size: int | None = None,
        rolling: bool = True,
        curve_every: int = 1000,
        reset_per_book: bool = False,
        settings: dict | None = None,
        record_tokens: bool = False,
        wide_chunks: bool = False,
        span: int | None = None,
        sliding: str = "window",
    ):
        chunk_size, span = forward_span(policy, chunk_size, span)
        if chunk_size < 1:
            raise H2OStreamError(f"chunk size must be >= 1, got {chunk_size}")
        if span < 1 or span % chunk_size:
            raise H2OStreamError(
                f"the span (tokens per forward) must be a multiple of the chunk size {chunk_size}, got {span}"
            )
        self.model = model
        self.policy = policy
        self.chunk_size = chunk_size
        self.span = span
        self.rolling = rolling
        self.curve_every = curve_every
        self.reset_per_book = reset_per_book
        # A span of several chunks is one forward that still decides every chunk (a scan, see engine/cache.py): the
        # same results as one forward per chunk, with the model's matrix products over the whole span.
        self.cache = StreamingCache(
            model,
            policy,
            rolling=rolling,
            wide_chunks=wide_chunks,
            decide_every=chunk_size if span > chunk_size else None,
            sliding=sliding,
        )
        self.cache.check_chunk_size(chunk_size)  # up front: the engine would refuse the second chunk otherwise
        context = self.cache.context
        width = span if self.cache.decide_every is None else chunk_size  # the most tokens one decision takes in
        if rolling and context and policy.budget is not None and policy.budget + width > context:
            raise H2OStreamError(
                f"cache size {policy.budget} + chunk size {width} exceeds the model's context "
                f"of {context} positions; use a smaller chunk or cache"
            )
        self.settings = {
            **(settings or {}),
            **policy.settings(),
            "chunk_size": chunk_size,
            "rolling": rolling,
            "reset_per_book": reset_per_book,
            "wide_chunks": wide_chunks,
        }
        if sliding != "window":  # recorded when not the default, so results made before the choice existed still match
            self.settings["sliding_layers"] = sliding
        self.position = 0  # stream tokens fed so far
        self.book = -1  # index of the book the last fed token belongs to
        self.book_start = 0  # stream position where chunking restarts (moves per book with reset_per_book)
        self.predicted = 0
        self.nll_sum = torch.zeros((), dtype=torch.float64)
        self.pending: torch.Tensor | None = None  # logits predicting the next token
        self.curve: list[tuple[int, float]] = []
        # RSS (stream position, bytes) at doublings of the stream position and of the tokens the current process has
        # fed, and at the end, so that memory growth can be read within one process of a run that spans several.
        self.rss_samples: list[tuple[int, int]] = []
        # Stream positions at which the run's processes began: 0, then one per resume (checkpoints from before this
        # was recorded contribute only the resumes since).
        self.process_starts: list[int] = [0]
        self.peak_rss = 0
        self.seconds = 0.0
        self.token_nll: list[torch.Tensor] | None = [] if record_tokens else None  # per-token NLLs, for tests
        self.digest = StreamDigest()  # of the tokens fed, with their book: binds checkpoints to the corpus

    # -- feeding -------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def feed_chunk(self, ids: torch.Tensor) -> None:
        """ids: (C,) tokens of one book, continuing the stream."""
        started = time.perf_counter()
        logits = self.model(ids.to(self.model.device).unsqueeze(0), cache=self.cache).logits[0]
        self.take_logits(ids, logits)
        self.seconds += time.perf_counter() - started

    def take_logits(self, ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Account for a forward of `ids` (C,) through this run's cache that gave `logits` (C, vocab): its NLL, the
        pending prediction, the stream position, the curve and memory samples (not the time: the caller's)."""
        self.digest.update(self.book, ids)
        ids = ids.to(logits.device)
        logits = logits.float()
        # the stream's (or, with reset_per_book, the book's) first token is not predicted; the others are, the first
        # of them by the pending logits (not concatenated with the chunk's: that copied all the logits once more)
        nll = token_nll(logits[:-1], ids[1:])
        if self.pending is not None:
            nll = torch.cat([token_nll(self.pending.unsqueeze(0), ids[:1]), nll])
        if self.token_nll is not None:
            self.token_nll.append(nll.cpu())
        before = self.predicted
        self.nll_sum += nll.double().sum()
        self.predicted += nll.numel()
        self.pending = logits[-1].clone()  # a view would keep (and checkpoint) the whole chunk's logits
        self.position += ids.numel()
        if self.predicted // self.curve_every > before // self.curve_every:
            self.curve.append((self.predicted, math.exp(self.nll_sum.item() / self.predicted)))
        self._sample_memory()

    def _sample_memory(self) -> None:
        rss = psutil.Process().memory_info().rss
        self.peak_rss = max(self.peak_rss, rss)
        start = self.process_starts[-1]
        last = self.rss_samples[-1][0] if self.rss_samples else 0
        own = last - start if last > start else 0  # tokens this process had fed at its last sample (0: none yet)
        if not own or self.position >= 2 * last or self.position - start >= 2 * own:
            self.rss_samples.append((self.position, rss))

    def start_book(self, index: int) -> None:
        if self.reset_per_book and index != self.book:
            self.cache.reset()
            self.pending = None
            self.book_start = self.position
        self.book = index

    def run(
        self,
        pieces: Iterable[tuple[int, torch.Tensor]],
        *,
        limit: int | None = None,
        on_progress=None,
        checkpoint=None,
        before_cut_short=None,
    ) -> None:
        """Consume (book index, token ids) pieces of the stream from the current position on (`feed_stream`)."""
        feed_stream(
            self, pieces, limit=limit, on_progress=on_progress, checkpoint=checkpoint, before_cut_short=before_cut_short
        )

    @property
    def running_ppl(self) -> float:
        return math.exp(self.nll_sum.item() / self.predicted) if self.predicted else float("nan")

    def result(self) -> PerplexityResult:
        if self.predicted and (not self.curve or self.curve[-1][0] != self.predicted):
            self.curve.append((self.predicted, math.exp(self.nll_sum.item() / self.predicted)))
        samples = list(self.rss_samples)
        if self.position and (not samples or samples[-1][0] != self.position):  # the end, however it falls
            samples.append((self.position, psutil.Process().memory_info().rss))
        return PerplexityResult(
            settings=self.settings,
            tokens_fed=self.position,
            predicted=self.predicted,
            nll_sum=self.nll_sum.item(),
            curve=list(self.curve),
            seconds=self.seconds,
            peak_rss_bytes=max([self.peak_rss, *(b for _, b in samples)]),
            rss_samples=samples,
            process_starts=list(self.process_starts),
            max_keys_seen=self.cache.max_keys_seen,
            span=self.span,
            kv_entries=self.cache.entries,
        )

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """Everything a resumed run needs, as plain data (tensors, numbers, text, lists, dicts)."""
        return {
            "settings": self.settings,
            "position": self.position,
            "book": self.book,
            "book_start": self.book_start,
            "predicted": self.predicted,
            "nll_sum": self.nll_sum,
            "pending": self.pending,
            "curve": self.curve,
            "rss_samples": self.rss_samples,
            "process_starts": self.process_starts,
            "peak_rss": self.peak_rss,
            "seconds": self.seconds,
            "stream": self.digest.state(),
            "cache": self.cache.state(),
        }

    def save(self, path: str | os.PathLike) -> None:
        """Atomic and verified: a killed or failed write (OSError, e.g. a full disk) leaves the previous checkpoint
        intact and no partial file."""
        write_verified(path, CHECKPOINT_KIND, CHECKPOINT_VERSION, self.state())

    def read(self, path: str | os.PathLike) -> dict:
        """The state in the checkpoint at `path`, once it is known to be an intact h2o-stream checkpoint made with
        this run's settings; an H2OStreamError naming the problem otherwise. The run is not changed."""
        try:
            state = read_verified(path, CHECKPOINT_KIND, CHECKPOINT_VERSION, map_location=self.model.device)
        except UnverifiedFile as error:
            raise H2OStreamError(
                f"cannot resume from {path}: the file {error}. A corrupt, foreign or altered "
                "checkpoint is never used: delete it to start that run afresh, or choose another "
                "--out"
            ) from None
        settings = state.get("settings") if isinstance(state, dict) else None
        if not isinstance(settings, dict):
            raise H2OStreamError(
                f"cannot resume from {path}: it holds no run settings; delete it or choose another --out"
            )
        if settings != self.settings:
            raise H2OStreamError(
                f"checkpoint {path} was made with other settings "
                f"({settings_difference(settings, self.settings)}); rerun with the same settings or "
                "choose another --out"
            )
        return state

    def load(self, path: str | os.PathLike) -> None:
        """Continue from the checkpoint at `path` (see `read`)."""
        self.restore(self.read(path), path)

    def restore(self, state: dict, path: str | os.PathLike = "the checkpoint") -> None:
        """Take over a state that `read` returned; a state that does not fit is an H2OStreamError, the run unchanged."""
        try:
            counters = [state[k] for k in ("position", "book", "book_start", "predicted")]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in counters) or min(counters[0::3]) < 0:
                raise ValueError("bad counters")
            if not isinstance(state["nll_sum"], torch.Tensor) or state["nll_sum"].dtype != torch.float64:
                raise ValueError("bad NLL sum")
            if state["pending"] is not None and not isinstance(state["pending"], torch.Tensor):
                raise ValueError("bad pending prediction")
            digest = StreamDigest(state["stream"])
            if digest.count != state["position"]:
                raise ValueError("the stream digest does not cover the position")
            curve = [(int(n), float(p)) for n, p in state["curve"]]
            rss_samples = [(int(n), int(b)) for n, b in state["rss_samples"]]
            starts = [int(n) for n in state.get("process_starts", [])]  # absent in checkpoints made before it
            if any(n > state["position"] for n in starts):
                raise ValueError("a process start beyond the position")
            peak_rss, seconds = int(state["peak_rss"]), float(state["seconds"])
            self.cache.load_state(state["cache"])
        except H2OStreamError:
            raise
        except Exception as error:  # noqa: BLE001 - any misfit is the same user problem
            raise H2OStreamError(
                f"checkpoint {path} does not fit this run ({one_line(error)}); delete it or choose another --out"
            ) from None
        self.position, self.book, self.book_start, self.predicted = counters
        self.nll_sum, self.pending, self.digest = state["nll_sum"], state["pending"], digest
        self.curve, self.rss_samples, self.peak_rss, self.seconds = curve, rss_samples, peak_rss, seconds
        # a resume adds its position (once: a process that resumed and fed nothing before it stopped adds nothing)
        self.process_starts = starts if starts[-1:] == [self.position] else [*starts, self.position]


def settings_difference(saved: dict, current: dict) -> str:
    """ "key: saved → current" for every setting that differs, e.g. "dtype: 'float32' → 'bfloat16'"."""
    differ = sorted(k for k in saved.keys() | current.keys() if saved.get(k) != current.get(k))
    listed = ", ".join(f"{k}: {saved.get(k)!r} → {current.get(k)!r}" for k in differ)
    if "data_sha256" in differ:  # the one difference a user may not see at a glance: say what it means
        return (
            "the corpus is another text: another corpus under the same name or one edited since would mix two "
            f"streams in one result; {listed}"
        )
    return listed


def stream_perplexity(
    model,
    tokenizer,
    tokens_or_texts,
    *,
    policy: str | EvictionPolicy = "h2o",
    cache_size: int | None = 256,
    chunk_size: int | None = None,
    rolling: bool = True,
    reset_per_book: bool = False,
    max_tokens: int | None = None,
    curve_every: int = 1000,
    wide_chunks: bool = False,
    span: int | None = None,
    sliding: str = "window",
    **parts: int | None,
) -> PerplexityResult:
    """Perplexity of a token stream (ids, a text, or texts/Books concatenated in order) under a fixed-size cache.

    `parts` are the policy's budget parts by name (e.g. heavy=64), as `make_policy` takes them. `chunk_size` None is
    the policy's default (`default_chunk_size`); chunks are fair (no query sees more than budget + 1 keys) unless
    `wide_chunks`. `span` (tokens per forward, a multiple of the chunk size; `stream.default_span`) changes speed only.
    `sliding` is what a model's sliding-window layers keep: "window" (their trained window) or "policy"
    (engine/layer_types.py)."""
    if not isinstance(policy, EvictionPolicy):
        policy = make_policy(policy, cache_size, **parts)
    run = PerplexityRun(
        model,
        policy,
        chunk_size=chunk_size,
        rolling=rolling,
        curve_every=curve_every,
        reset_per_book=reset_per_book,
        wide_chunks=wide_chunks,
        span=span,
        sliding=sliding,
    )
    run.run(token_pieces(tokens_or_texts, tokenizer), limit=max_tokens)
    return run.result()
