"""Generation: the one decode loop that chat, summarize and the evaluations share, over a fixed-size cache.

Tokens go through the engine one at a time (`h2o_stream.engine.feed` into a `StreamingCache`), so the history is
never re-fed and memory stays flat; choosing a token and turning tokens into text is transformers' own work
(`LogitsProcessorList` of its processors and warpers, `TextStreamer`). Imports only engine, errors and files.

Public API
----------
``Sampling(temperature=0.7, top_p=0.9, max_new_tokens=256, seed=None, top_k=0, repetition_penalty=1.0,
no_repeat_ngram_size=0)``
    Settings, checked on construction (H2OStreamError naming the bad one). temperature 0 = greedy; seed None = a
    random seed, drawn and stored in `.seed`; seeds are 0 to `MAX_SEED` (2**64 - 1, torch's). Repetition controls are
    off unless asked for. ``check_sampling(options=False, **settings)`` runs the same checks on settings by name,
    naming a bad one as the field (top_p) or, with `options`, as a command's option (--top-p).

``logits_processors(sampling) -> transformers.LogitsProcessorList``
    RepetitionPenaltyLogitsProcessor, NoRepeatNGramLogitsProcessor, then (sampling only) TemperatureLogitsWarper,
    TopKLogitsWarper, TopPLogitsWarper: the classes and order `model.generate` uses for the same settings (top-p as
    `SortFreeTopPLogitsWarper`, a subclass with the same output that skips the parent's index sort on CPU).

``pick_token(logits, seen, sampling, processors, generator) -> int``
    One step: processors over `seen` (list of ids), then argmax (greedy) or a draw from `generator`.

``stop_token_ids(tokenizer, model=None, *, chat_template=True) -> set[int]``
    tokenizer.eos_token_id | model.generation_config.eos_token_id | the chat template's end-of-turn token.
    Also: ``end_of_turn_id(tokenizer)``, ``closing_text(tokenizer, system=None)`` (the text a template puts after a
    reply), ``render(tokenizer, messages, generation_prompt=...)``, ``suffix``, ``TemplateError``,
    ``STAND_IN_USER`` / ``STAND_IN_REPLY``.

``generate(model, tokenizer, cache, logits, sampling, *, stop_ids, generator=None, stop_strings=(), context_ids=(),
max_new_tokens=None, should_stop=None, on_text=None) -> Generation``
    `cache`: a StreamingCache that already holds the prompt; `logits` (vocab,): the prediction after it (what
    `feed` returned). Decodes up to `max_new_tokens` (default `sampling.max_new_tokens`), one forward per token,
    calling `on_text(piece)` as text becomes final. `should_stop()` is polled before each token (True: stop,
    "cancelled"). `generator`: default a torch.Generator seeded with `sampling.seed`; pass your own to continue or
    restore a random stream. `context_ids`: ids the repetition controls count before the reply (default none).

``Generation``: `token_ids` (stop token excluded), `text` (= the streamed pieces joined: special tokens skipped,
cut before a stop string, leading whitespace dropped), `stop_reason` ("eos" | "length" | "cancelled"),
`stop_string` (which one, or None), `fed` (how many of token_ids are in the cache: the last one is not when the
length or a stop string ended the reply), `seconds`.

``Decoder(model, tokenizer, sampling, *, stop_ids, generator=None, stop_strings=(), context_ids=())``
    What `generate` runs, as a generator: ``for piece in decoder.stream(cache, logits, max_new_tokens=None,
    should_stop=None): ...``; the generator returns the Generation, which is also `decoder.result` (kept current,
    so a consumer that closes the stream early still reads what was generated).

``TextStream(tokenizer, stop_strings=())``
    transformers' TextStreamer as an incremental detokenizer: `push(token) -> str`, `finish() -> str`,
    `stopped` (the stop string seen, or None).

Summarize, for example::

    cache = StreamingCache(model, policy)
    logits = feed(model, cache, prompt_ids, chunk_size)
    result = generate(model, tokenizer, cache, logits, Sampling(temperature=0, max_new_tokens=256,
                      repetition_penalty=1.2), stop_ids=stop_token_ids(tokenizer, model), on_text=print)
    result.text, result.token_ids, result.stop_reason
"""

from .decode import STOP_REASONS, Decoder, Generation, generate
from .sampling import MAX_SEED, Sampling, check_sampling, logits_processors, pick_token
from .stops import (
    STAND_IN_REPLY,
    STAND_IN_USER,
    TemplateError,
    closing_text,
    end_of_turn_id,
    render,
    stop_token_ids,
    suffix,
)
from .stream import TextStream

__all__ = [
    "MAX_SEED",
    "STAND_IN_REPLY",
    "STAND_IN_USER",
    "STOP_REASONS",
    "Decoder",
    "Generation",
    "Sampling",
    "TemplateError",
    "TextStream",
    "check_sampling",
    "closing_text",
    "end_of_turn_id",
    "generate",
    "logits_processors",
    "pick_token",
    "render",
    "stop_token_ids",
    "suffix",
]
