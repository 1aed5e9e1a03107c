"""Sampling settings and the choice of the next token, built on transformers' logits processors.

`logits_processors(sampling)` is the `LogitsProcessorList` that `model.generate` would build from the same settings
(same classes, same order: repetition penalty, no-repeat n-gram, then temperature, top-k, top-p when sampling);
`pick_token` applies it and takes the argmax (temperature 0) or draws from the result with a `torch.Generator`, as
`model.generate(do_sample=True)` draws with torch's global one, so a seed gives the same tokens every run.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch
from transformers import (LogitsProcessorList, NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

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
            processors.append(TopPLogitsWarper(sampling.top_p))
    return processors


def pick_token(logits: torch.Tensor, seen: list[int], sampling: Sampling, processors: LogitsProcessorList,
               generator: torch.Generator | None) -> int:
    """The next token after `logits` (vocab,), with `seen` the ids the processors look at (the reply so far, after
    any context). Scores are taken to CPU float32 first, so a seed draws the same tokens on any device."""
    scores = logits.detach().reshape(1, -1).to("cpu", torch.float32)
    if processors:
        scores = processors(torch.tensor([seen], dtype=torch.long), scores)
    if sampling.greedy:
        return int(torch.argmax(scores, dim=-1))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
