"""The decode loop: one token per forward pass through a `StreamingCache`, for chat, summarize and the evaluations.

Not `model.generate`: that re-feeds or keeps the whole history, while here the cache is bounded and only the newest
token goes in at each step. Everything else is transformers' (logits processors, the streamer's detokenizing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field

import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.engine.feed import feed

from .sampling import Sampling, logits_processors, pick_token
from .stream import TextStream

STOP_REASONS = ("eos", "length", "cancelled")


@dataclass
class Generation:
    """What a decode produced, and why it ended.

    `token_ids`: the tokens kept (a stop token is not kept). `text`: their decoding (special tokens skipped), cut
    before a stop string, leading whitespace dropped; exactly the streamed pieces joined. `stop_reason`: "eos" (a
    stop token or a stop string), "length" (max_new_tokens reached) or "cancelled" (`should_stop` said so).
    `fed`: how many of `token_ids` are in the cache; the rest (at most the last token, when a stop string or the
    length ended the reply) were never fed, as their logits were not needed. `seconds`: time spent decoding, not
    counting the time the consumer of the stream held it.
    """

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    stop_reason: str = "length"
    stop_string: str | None = None
    fed: int = 0
    seconds: float = 0.0


class Decoder:
    """Decodes replies from a model whose cache holds the prompt. One per sampling setting; `stream` may be run again
    (e.g. once per chat turn), each run starting a new Generation.

    `stop_ids`: tokens that end a reply (see `stop_token_ids`). `generator`: the torch.Generator sampling draws
    from (default: one seeded with `sampling.seed`); the caller may save and restore its state. `stop_strings`: text
    that ends a reply (the text before it is kept). `context_ids`: tokens the repetition controls also count, before
    the reply (as `model.generate` counts the prompt); default none, so only the reply itself is penalized.
    `strip_start`: drop the reply's leading whitespace (False for a text that continues a prompt).
    """

    def __init__(
        self,
        model,
        tokenizer,
        sampling: Sampling,
        *,
        stop_ids: Iterable[int],
        generator: torch.Generator | None = None,
        stop_strings: tuple[str, ...] = (),
        context_ids: Iterable[int] = (),
        strip_start: bool = True,
    ):
        self.model, self.tokenizer, self.sampling = model, tokenizer, sampling
        self.strip_start = strip_start
        self.stop_ids = set(stop_ids)
        self.generator = generator if generator is not None else sampling.new_generator()
        self.stop_strings = tuple(stop_strings)
        self.context_ids = list(context_ids)
        self.processors = logits_processors(sampling)
        self.result = Generation()

    def stream(
        self,
        cache: StreamingCache,
        logits: torch.Tensor,
        *,
        max_new_tokens: int | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generator[str, None, Generation]:
        """Generate from `logits` (vocab,), the prediction after the prompt in `cache`, yielding text as it becomes
        final; returns the Generation (also `self.result`, which stays current if the stream is closed early).
        `should_stop()` is polled before every token; True ends the reply there ("cancelled")."""
        limit = max_new_tokens or self.sampling.max_new_tokens
        result = self.result = Generation()
        text = TextStream(self.tokenizer, self.stop_strings, strip_start=self.strip_start)
        start = time.perf_counter()
        for step in range(limit):
            if should_stop is not None and should_stop():
                result.stop_reason = "cancelled"
                break
            token = pick_token(
                logits, self.context_ids + result.token_ids, self.sampling, self.processors, self.generator
            )
            if token in self.stop_ids:
                result.stop_reason = "eos"
                break
            result.token_ids.append(token)
            piece = text.push(token)
            if piece:
                result.text += piece
                result.seconds += time.perf_counter() - start
                yield piece
                start = time.perf_counter()
            if text.stopped is not None:
                result.stop_reason, result.stop_string = "eos", text.stopped
                break
            if step + 1 < limit:  # the last token's logits are never needed
                logits = feed(self.model, cache, torch.tensor([[token]]))
                result.fed += 1
        result.seconds += time.perf_counter() - start
        rest = text.finish()
        if text.stopped is not None and result.stop_string is None:  # seen only in text held back until the end
            result.stop_reason, result.stop_string = "eos", text.stopped
        if rest:
            result.text += rest
            yield rest
        return result


def generate(
    model,
    tokenizer,
    cache: StreamingCache,
    logits: torch.Tensor,
    sampling: Sampling,
    *,
    stop_ids: Iterable[int],
    generator: torch.Generator | None = None,
    stop_strings: tuple[str, ...] = (),
    context_ids: Iterable[int] = (),
    max_new_tokens: int | None = None,
    should_stop: Callable[[], bool] | None = None,
    on_text: Callable[[str], None] | None = None,
) -> Generation:
    """Decode one reply (see `Decoder`), passing each piece of text to `on_text` as it becomes final."""
    decoder = Decoder(
        model,
        tokenizer,
        sampling,
        stop_ids=stop_ids,
        generator=generator,
        stop_strings=stop_strings,
        context_ids=context_ids,
    )
    for piece in decoder.stream(cache, logits, max_new_tokens=max_new_tokens, should_stop=should_stop):
        if on_text is not None:
            on_text(piece)
    return decoder.result
