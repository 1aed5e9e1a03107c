"""Sampling settings and the choice of the next token, built on transformers' logits processors.

`logits_processors(sampling)` is the `LogitsProcessorList` that `model.generate` would build from the same settings
(same classes, same order: repetition penalty, no-repeat n-gram, then temperature, top-k, top-p when sampling);
`pick_token` applies it and takes the argmax (temperature 0) or draws from the result with a `torch.Generator`, as
`model.generate(do_sample=True)` draws with torch's global one, so a seed gives the same tokens every run.
"""

from __future__ import annotations

import math
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

from h2o_stream.errors import H2OStreamError, option_name

#: the largest seed: torch.Generator.manual_seed takes 64-bit seeds (a negative one is taken as 2**64 plus it, the
#: same stream as a seed in range, so seeds are 0..MAX_SEED and each names one stream)
MAX_SEED = 2**64 - 1


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
        check_sampling(
            temperature=self.temperature,
            top_p=self.top_p,
            max_new_tokens=self.max_new_tokens,
            seed=self.seed,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
        )
        if self.seed is None:
            self.seed = secrets.randbits(63)
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


#: the checks of Sampling's fields: a number with its test, or an integer with its bounds
# finite: an infinite temperature or penalty turns every logit into 0 or NaN, which samples nothing meaningful
_NUMBERS = {
    "temperature": (lambda x: 0 <= x < math.inf, ">= 0 and finite"),
    "top_p": (lambda x: 0 < x <= 1, "in (0, 1]"),
    "repetition_penalty": (lambda x: 1 <= x < math.inf, ">= 1 (1 = off) and finite"),
}
_INTEGERS = {"max_new_tokens": (1, None), "top_k": (0, None), "no_repeat_ngram_size": (0, None), "seed": (0, MAX_SEED)}


def check_sampling(*, options: bool = False, **settings) -> None:
    """Refuse a bad sampling setting (`Sampling`'s fields by name; those not given are not checked; seed None is a
    random seed) with one message naming it: as the field (top_p), or with `options` as a command's option names it
    (--top-p)."""
    name = option_name if options else str
    for key, value in settings.items():
        if key in _NUMBERS:
            _check_number(name(key), value, *_NUMBERS[key])
        elif key in _INTEGERS:
            if not (key == "seed" and value is None):
                _check_int(name(key), value, *_INTEGERS[key])
        else:
            raise H2OStreamError(f"no sampling setting is named {key}; they are {', '.join([*_NUMBERS, *_INTEGERS])}")


def _check_number(name: str, value, ok, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise H2OStreamError(f"{name} must be a number {what}, got {value!r}")


def _check_int(name: str, value, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        what = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise H2OStreamError(f"{name} must be an integer {what}, got {value!r}")


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

    The parent sorts the whole vocabulary with its indices (torch.sort, at every decode step) to find the cut. The
    cut only needs the sorted values (np.sort of the values alone, no indices carried along; the same values in the
    same order, so the same softmax and cumulative sums): every token below the first kept value
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
