"""summarize(): a document of any length through a fixed-size KV cache, then a summary."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict

import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.generation import Sampling
from h2o_stream.loading import models

from . import strategies
from .documents import as_document
from .prompts import build_prompt, encode
from .reader import Reader
from .results import SectionSummary, SummaryResult
from .settings import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_INSTRUCTION,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NO_REPEAT_NGRAM_SIZE,
    DEFAULT_POLICY,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_SECTION_INSTRUCTION,
    DEFAULT_SECTION_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    check_settings,
    positive_int,
)


def summarize(
    text_or_path,
    model=None,
    *,
    policy: str = DEFAULT_POLICY,
    cache_size: int | None = DEFAULT_CACHE_SIZE,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    instruction: str = DEFAULT_INSTRUCTION,
    strategy: str = "single",
    section_tokens: int | None = None,
    section_max_new_tokens: int = DEFAULT_SECTION_MAX_NEW_TOKENS,
    section_instruction: str = DEFAULT_SECTION_INSTRUCTION,
    book: int | str | None = None,
    rolling: bool = True,
    temperature: float = DEFAULT_TEMPERATURE,
    top_p: float = DEFAULT_TOP_P,
    seed: int | None = None,
    repetition_penalty: float = DEFAULT_REPETITION_PENALTY,
    no_repeat_ngram_size: int = DEFAULT_NO_REPEAT_NGRAM_SIZE,
    dtype: str = "float32",
    device: str = "cpu",
    threads: int | None = None,
    on_progress: Callable[[int, int], None] | None = None,
    on_text: Callable[[str], None] | None = None,
    on_section: Callable[[SectionSummary], None] | None = None,
    on_warning: Callable[[str], None] | None = None,
    **parts: int | None,
) -> SummaryResult:
    """Summarize a document of any length with a fixed-size KV cache.

    `text_or_path`: the text itself, a `Document`, or a corpus read by `h2o_stream.loading.corpus` ("sample", a
    UTF-8 text file, a PG-19 .jsonl/.jsonl.gz, ...; `book` = index or title picks one of several). `model`: None
    (the default model), a model spec for `load_model`, a `LoadedModel`, or a `(model, tokenizer)` pair.
    `parts`: the policy's budget parts (e.g. heavy=64, recent=192). `strategy`: "single" or "hierarchical" (sections
    of `section_tokens` tokens, default the cache size, each summarized in `section_max_new_tokens` tokens, then
    combined). Decoding: `temperature` 0 = greedy; `top_p` when sampling; `seed` makes sampling repeatable (None: a
    random one, recorded in the result); `repetition_penalty` and `no_repeat_ngram_size` as in transformers.

    `on_progress(done, total)` reports document tokens read; `on_text(piece)` streams the final summary as it is
    generated; `on_section(section)` sees each section summary (hierarchical); `on_warning(text)` hears of a
    problem that does not stop the work, e.g. an instruction longer than the cache (default: `warnings.warn`).
    """
    started = time.perf_counter()
    # Every argument is checked before the document is read or the model loaded.
    instruction, max_new_tokens, section_instruction = check_settings(
        strategy=strategy,
        instruction=instruction,
        max_new_tokens=max_new_tokens,
        policy=policy,
        cache_size=cache_size,
        chunk_size=chunk_size,
        section_tokens=section_tokens,
        section_max_new_tokens=section_max_new_tokens,
        section_instruction=section_instruction,
        parts=parts,
    )
    sampling = Sampling(
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        seed=seed,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
    )
    document = as_document(text_or_path, book=book)
    net, tokenizer, name = resolve_model(model, dtype=dtype, device=device, threads=threads)
    reader = Reader(
        net,
        tokenizer,
        policy=policy,
        cache_size=cache_size,
        chunk_size=chunk_size,
        rolling=rolling,
        sampling=sampling,
        **parts,
    )
    sections_asked = section_instruction if strategy == "hierarchical" else None
    for problem in instruction_warnings(reader, instruction, sections_asked):
        if on_warning is not None:
            on_warning(problem)
        else:
            warnings.warn(problem, stacklevel=2)

    ids = encode(tokenizer, document.text)
    if not ids:
        raise H2OStreamError("the document is empty after tokenization: there is nothing to summarize")
    total = len(ids)
    report = (lambda done: on_progress(done, total)) if on_progress is not None else None
    sections: list[SectionSummary] = []
    if strategy == "single":
        text = strategies.single(reader, ids, instruction, max_new_tokens, report, on_text)
    else:
        size = section_tokens or reader.policy.budget or DEFAULT_CACHE_SIZE
        text = strategies.hierarchical(
            reader,
            ids,
            size,
            instruction,
            max_new_tokens,
            section_instruction,
            section_max_new_tokens,
            report,
            on_text,
            on_section,
            sections,
        )
    run = reader.run
    return SummaryResult(
        text=text,
        tokens_read=total,
        evictions=run.evictions,
        seconds=time.perf_counter() - started,
        strategy=strategy,
        policy=reader.policy.settings(),
        cache_size=reader.policy.budget,
        chunk_size=chunk_size,
        rolling=reader.rolling,
        tokens_generated=run.tokens_generated,
        tokens_fed=run.tokens_fed,
        peak_slots=run.peak_slots,
        read_seconds=run.read_seconds,
        generate_seconds=run.generate_seconds,
        title=document.title,
        source=document.source,
        model=name,
        chat_template=build_prompt(tokenizer, instruction).chat,
        sections=sections,
        sampling=asdict(sampling),
        stop_reason=run.stop_reason,
    )


def instruction_warnings(reader: Reader, instruction: str, section_instruction: str | None = None) -> list[str]:
    """A warning for each instruction that, with the prompt's closing tokens, is longer than the cache: the model
    cannot see all of it when it answers (the policy evicts part of it while it is read)."""
    budget = reader.policy.budget
    found = []
    for label, text in (("instruction", instruction), ("section instruction", section_instruction)):
        if budget is None or text is None:
            continue
        length = len(build_prompt(reader.tokenizer, text).suffix)
        if length > budget:
            found.append(
                f"the {label} is {length} tokens with the prompt's closing, more than the cache holds "
                f"({budget} entries): the model cannot see all of it when it writes the summary; shorten "
                "it or use a larger cache (--cache-size)"
            )
    return found


def resolve_model(model, *, dtype: str = "float32", device: str = "cpu", threads: int | None = None):
    """(model, tokenizer, name) from None / a spec string / a LoadedModel / a (model, tokenizer) pair."""
    if model is None or isinstance(model, (str, os.PathLike)):
        loaded = models.load_model(model, dtype=dtype, device=device, threads=threads)
        return loaded.model, loaded.tokenizer, loaded.name
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, model.tokenizer, getattr(model, "name", None)
    if threads is not None:  # load_model applies it for the other forms
        torch.set_num_threads(positive_int("threads", threads))
    if isinstance(model, (tuple, list)) and len(model) == 2:
        net, tokenizer = model
        return net, tokenizer, getattr(getattr(net, "config", None), "_name_or_path", None) or None
    raise H2OStreamError(
        f"model must be a model spec, a LoadedModel or a (model, tokenizer) pair, got {type(model).__name__}"
    )
