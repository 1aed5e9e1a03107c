"""The engine of summarize: token ids read through fresh fixed-budget caches, then a reply decoded with
`h2o_stream.generation` (the decode loop chat and the evaluations share)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.engine.feed import feed
from h2o_stream.engine.policies import make_policy
from h2o_stream.errors import H2OStreamError
from h2o_stream.generation import Sampling, generate, stop_token_ids

from .prompts import Prompt
from .settings import DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE, DEFAULT_POLICY, positive_int


@dataclass
class Counters:
    """Counted over every pass of one summarize() call."""

    evictions: int = 0
    tokens_generated: int = 0
    tokens_fed: int = 0
    peak_slots: int = 0
    read_seconds: float = 0.0
    generate_seconds: float = 0.0
    stop_reason: str = ""  # why the last reply ended: "eos" or "length" (the token limit)


class Reader:
    """Reads token ids through fresh fixed-budget caches and answers; one per model, cache and sampling setting.

    `parts` are the policy's budget parts (e.g. heavy=64), as `make_policy` takes them. `sampling`: how tokens are
    chosen (default: `Sampling()`'s). One random stream (seeded with `sampling.seed`) serves every reply.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        policy: str = DEFAULT_POLICY,
        cache_size: int | None = DEFAULT_CACHE_SIZE,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        rolling: bool = True,
        sampling: Sampling | None = None,
        **parts: int | None,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.policy = make_policy(policy, cache_size, tokenizer=tokenizer, **parts)
        self.chunk_size = positive_int("chunk_size", chunk_size)
        self.rolling = bool(rolling)
        self.sampling = sampling if sampling is not None else Sampling()
        self.generator = self.sampling.new_generator()
        self.stops = stop_token_ids(tokenizer, model)
        config = model.config.get_text_config(decoder=True)
        self.context = getattr(config, "max_position_embeddings", None)
        budget = self.policy.budget
        if self.rolling and budget is not None and self.context is not None and budget + self.chunk_size > self.context:
            raise H2OStreamError(
                f"cache size {budget} + chunk size {self.chunk_size} exceeds the model's context of {self.context} "
                f"positions: use a chunk size of at most {self.context - budget}"
            )
        self.run = Counters()

    def new_cache(self) -> StreamingCache:
        """A fresh cache with this reader's policy and rolling. The document goes in wide chunks: each token sees all
        the cache holds (fair chunks, which cut before a chunk so that no query sees more than budget + 1 keys, exist
        to compare policies' perplexity; a chunk as large as the cache would leave almost nothing to read from)."""
        return StreamingCache(self.model, self.policy, rolling=self.rolling, wide_chunks=True)

    def check_length(self, total: int, max_new_tokens: int) -> None:
        """The full policy (no eviction) is bounded by the model's context; refuse before any work."""
        if self.policy.budget is None and self.context is not None and total + max_new_tokens > self.context:
            raise H2OStreamError(
                f"the full policy keeps every token, and {total} prompt tokens + {max_new_tokens} new tokens exceed "
                f"the model's context of {self.context}: use a bounded policy (h2o, sink, window)"
            )

    @torch.no_grad()
    def read(
        self, cache: StreamingCache, ids: Sequence[int], on_progress: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """Feed `ids` into `cache` in chunks; `on_progress(n)` after each chunk with the tokens fed so far. Returns
        the prediction after the last token (vocab,)."""
        start = time.perf_counter()
        tensor = torch.tensor([list(ids)], dtype=torch.long)
        logits = None
        for offset in range(0, tensor.shape[1], self.chunk_size):  # chunk by chunk, to report progress
            piece = tensor[:, offset : offset + self.chunk_size]
            logits = feed(self.model, cache, piece, self.chunk_size)
            self._observe(cache)
            if on_progress is not None:
                on_progress(offset + piece.shape[1])
        assert logits is not None, "nothing to read"  # answer() always reads at least the prompt's suffix
        self.run.tokens_fed += tensor.shape[1]
        self.run.read_seconds += time.perf_counter() - start
        return logits

    def generate(
        self,
        cache: StreamingCache,
        logits: torch.Tensor,
        max_new_tokens: int,
        on_text: Callable[[str], None] | None = None,
    ) -> str:
        """Decode up to `max_new_tokens` from `logits` (the next-token prediction); the reply, stripped."""
        start = time.perf_counter()
        reply = generate(
            self.model,
            self.tokenizer,
            cache,
            logits,
            self.sampling,
            stop_ids=self.stops,
            generator=self.generator,
            max_new_tokens=max_new_tokens,
            on_text=on_text,
        )
        self._observe(cache)  # a cache never shrinks, so its size at the end is its peak
        self.run.tokens_fed += reply.fed
        self.run.tokens_generated += len(reply.token_ids)
        self.run.stop_reason = reply.stop_reason
        self.run.generate_seconds += time.perf_counter() - start
        return reply.text.strip()

    def answer(
        self,
        ids: Sequence[int],
        prompt: Prompt,
        max_new_tokens: int,
        on_progress: Callable[[int], None] | None = None,
        on_text: Callable[[str], None] | None = None,
    ) -> tuple[str, int]:
        """Read prompt.prefix + ids + prompt.suffix into a fresh cache and generate; (text, evictions)."""
        full = [*prompt.prefix, *ids, *prompt.suffix]
        self.check_length(len(full), max_new_tokens)
        skip, count = len(prompt.prefix), len(ids)

        def progress(done: int) -> None:
            if on_progress is not None:
                on_progress(min(max(done - skip, 0), count))

        cache = self.new_cache()
        logits = self.read(cache, full, progress)
        text = self.generate(cache, logits, max_new_tokens, on_text)
        self.run.evictions += cache.evicted
        return text, cache.evicted

    def _observe(self, cache: StreamingCache) -> None:
        self.run.peak_slots = max(self.run.peak_slots, cache.slots)
