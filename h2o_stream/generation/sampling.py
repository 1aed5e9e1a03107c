"""Sampling settings and the choice of the next token, built on transformers' logits processors.

`logits_processors(sampling)` is the `LogitsProcessorList` that `model.generate` would build from the same settings
(same classes, same order: repetition penalty, no-repeat n-gram, then temperature, top-k, top-p when sampling);
`pick_token` applies it and takes the argmax (temperature 0) or draws from the result with a `torch.Generator`, as
`model.generate(do_sample=True)` draws with torch's global one, so a seed gives the same tokens every run.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from transformers import (
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from h2o_stream.errors import H2OStreamError


@dataclass
class Sampling:
    """How the next token is chosen. Unset fields take these defaults: nucleus sampling, repetition controls off (each
    application states its own defaults: the chat's in `h2o_stream.apps.chat.CHAT_SAMPLING`, summarize's in its
    settings).

    temperature 0 = greedy (the repetition controls still apply); top_k 0 and top_p 1 = no cut; repetition_penalty
    1 = off (transformers' CTRL-style penalty on tokens already in the reply); no_repeat_ngram_size 0 = off (no
    n-gram of that many tokens occurs twice in a reply); seed None = a random one (drawn here and recorded, so a run
    can be repeated).
    """

    temperature: float = 0.7
    top_p: float = 0.9
    max_new_tokens: int = 256
    seed: int | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0

    def __post_init__(self):
        _check_number("temperature", self.temperature, lambda v: v >= 0, ">= 0")
        _check_number("top-p", self.top_p, lambda v: 0 < v <= 1, "in (0, 1]")
        _check_number("repetition-penalty", self.repetition_penalty, lambda v: v >= 1, ">= 1 (1 = off)")
        _check_int("max-new-tokens", self.max_new_tokens, 1)
        _check_int("top-k", self.top_k, 0)
        _check_int("no-repeat-ngram-size", self.no_repeat_ngram_size, 0)
        if self.seed is None:
            self.seed = secrets.randbits(63)
        else:
            _check_int("seed", self.seed, 0)
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)
        self.repetition_penalty = float(self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def new_generator(self) -> torch.Generator:
        """A torch.Generator seeded with `seed`: the same stream of draws for the same seed."""
        assert self.seed is not None  # __post_init__ draws one when none is given
        return torch.Generator().manual_seed(self.seed)


def _check_number(name: str, value, ok, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise H2OStreamError(f"{name} must be a number {what}, got {value!r}")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise H2OStreamError(f"{name} must be an integer >= {low}, got {value!r}")


def logits_processors(sampling: Sampling) -> LogitsProcessorList:
    """transformers' processors for `sampling`, in `model.generate`'s order; the warpers only when sampling."""
    processors = LogitsProcessorList()
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.no_repeat_ngram_size > 0:
        processors.append(NoRepeatNGramLogitsProcessor(sampling.no_repeat_ngram_size))
    if not sampling.greedy:
        if sampling.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k > 0:
            processors.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            processors.append(SortFreeTopPLogitsWarper(sampling.top_p))
    return processors


class SortFreeTopPLogitsWarper(TopPLogitsWarper):
    """transformers' `TopPLogitsWarper`, the same output bit for bit, without its index sort on CPU.

    The parent sorts the whole vocabulary with its indices (torch.sort: ~3 ms of a ~60 ms decode step for a 49k
    vocabulary on one core) to find the cut. The cut only needs the sorted values (np.sort, a tenth of the time; the
    same values in the same order, so the same softmax and cumulative sums): every token below the first kept value
    goes. Only when the cut falls inside a run of equal values does torch.sort's tie order decide which of them stay:
    then, and for batches, other devices or dtypes, and NaN, the parent does the work.
    """

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 1 or scores.device.type != "cpu" or scores.dtype != torch.float32:
            return super().__call__(input_ids, scores)
        values = torch.from_numpy(np.sort(scores.numpy(), axis=-1)).clone()  # torch's allocation, as the parent's
        if values.isnan().any():
            return super().__call__(input_ids, scores)
        cumulative = values.softmax(dim=-1).cumsum(dim=-1)  # non-decreasing: the parent's removals are a prefix
        cut = min(int((cumulative <= (1 - self.top_p)).sum()), values.shape[-1] - self.min_tokens_to_keep)
        if cut == 0:
            return scores.clone()
        threshold = values[0, cut]
        if values[0, cut - 1] == threshold:
            return super().__call__(input_ids, scores)
        return scores.masked_fill(scores < threshold, self.filter_value)


def pick_token(
    logits: torch.Tensor,
    seen: list[int],
    sampling: Sampling,
    processors: LogitsProcessorList,
    generator: torch.Generator | None,
) -> int:
    """The next token after `logits` (vocab,), with `seen` the ids the processors look at (the reply so far, after
    any context). Scores are taken to CPU float32 first, so a seed draws the same tokens on any device."""
    scores = logits.detach().reshape(1, -1).to("cpu", torch.float32)
    if processors:
        # an int64 CPU tensor is a torch.LongTensor (isinstance agrees), which transformers' processors are
        # annotated to take; torch.tensor is annotated to return a plain Tensor
        seen_ids = cast(torch.LongTensor, torch.tensor([seen], dtype=torch.long))
        scores = processors(seen_ids, scores)
    if sampling.greedy:
        return int(torch.argmax(scores, dim=-1))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
