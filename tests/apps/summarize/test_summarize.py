"""summarize(): the single-pass and hierarchical strategies, their statistics and budget, the settings checks, and
(marked slow) a 20k-token book excerpt from the shipped sample with the real default model.

Everything else runs offline on a tiny random llama with a tiny byte-level BPE tokenizer (conftest's fixtures,
trained on TRAINING_TEXTS, with SmolLM2's chat template). Beside this file: documents in
test_summarize_documents.py, prompts in test_summarize_prompts.py, the command in test_summarize_cli.py.
"""

from __future__ import annotations

import math
import time

import pytest
import torch

from h2o_stream import H2OStreamError
from h2o_stream.apps.summarize import build_prompt, encode, load_document, summarize
from support.summarize_helpers import TRAINING_TEXTS, BudgetWatch, run, words  # noqa: F401  (TRAINING_TEXTS: conftest)
from support.tiny_models import tiny_llama

# The machine running these is shared: keep this process to one core.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def document():
    return words(900)


# --- single pass ---------------------------------------------------------------------------------------------------


# knorm and random are policies of one score() each
@pytest.mark.parametrize("policy", ["h2o", "sink", "window", "knorm", "random"])
def test_single_pass_returns_text_exact_stats_and_stays_within_the_budget(model, tokenizer, document, policy):
    progress = []
    result, watch = run(model, tokenizer, document, policy=policy, on_progress=lambda d, t: progress.append((d, t)))
    budget = 48
    doc_tokens = len(tokenizer(document, add_special_tokens=False).input_ids)
    prompt = build_prompt(tokenizer, "Summarize the document above in a few sentences.")
    assert isinstance(result.text, str) and result.text
    assert result.strategy == "single" and result.policy["policy"] == policy and result.cache_size == budget
    assert result.tokens_read == doc_tokens > 10 * budget
    assert 1 <= result.tokens_generated <= 6
    # Everything fed: the prompt around the document, and each generated token but the last.
    fed = len(prompt.prefix) + doc_tokens + len(prompt.suffix) + result.tokens_generated - 1
    assert result.tokens_fed in (fed, fed + 1)  # +1 when generation stopped at an end-of-turn token
    # Every entry beyond the budget was evicted, in every layer and KV head.
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert result.evictions == (result.tokens_fed - budget) * layers * kv_heads > 0
    assert watch.budgets == {budget} and len(watch.caches) == 1
    assert max(watch.after) == budget == result.peak_slots
    assert watch.caches[0].seen == result.tokens_fed
    assert progress[-1] == (doc_tokens, doc_tokens) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert result.seconds >= result.read_seconds > 0 and result.chat_template


def test_greedy_is_deterministic_and_streamed_text_is_the_summary(model, tokenizer, document):
    pieces = []
    first, _ = run(model, tokenizer, document, on_text=pieces.append, max_new_tokens=10)
    second, _ = run(model, tokenizer, document, max_new_tokens=10)
    assert first.text == second.text and "".join(pieces).strip() == first.text
    sampled = [run(model, tokenizer, document, max_new_tokens=10, temperature=1.5, seed=s)[0].text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]


def test_exact_mode_and_short_documents(model, tokenizer):
    text = words(30)
    result, watch = run(model, tokenizer, text, chunk_size=1, cache_size=256)
    assert result.tokens_read == len(encode(tokenizer, text)) and result.evictions == 0
    assert max(watch.after) <= 256


def test_full_policy_refuses_a_document_beyond_the_context_before_reading(tokenizer):
    small = tiny_llama(len(tokenizer), context=128)
    watch = BudgetWatch(small)
    with pytest.raises(H2OStreamError, match="full policy keeps every token.*context of 128"):
        summarize(words(300), (small, tokenizer), policy="full", cache_size=None, chunk_size=16)
    watch.close()
    assert watch.after == []


# --- hierarchical --------------------------------------------------------------------------------------------------


def test_hierarchical_summarizes_every_section_then_the_summaries(model, tokenizer, document):
    seen = []
    result, watch = run(
        model,
        tokenizer,
        document,
        strategy="hierarchical",
        section_tokens=80,
        section_max_new_tokens=12,
        on_section=seen.append,
    )
    doc_tokens = len(encode(tokenizer, document))
    level0 = [s for s in result.sections if s.level == 0]
    assert result.strategy == "hierarchical" and result.tokens_read == doc_tokens
    assert len(level0) == math.ceil(doc_tokens / 80)
    assert [(s.start, s.end) for s in level0] == [(i, min(i + 80, doc_tokens)) for i in range(0, doc_tokens, 80)]
    assert all(isinstance(s.text, str) for s in result.sections) and seen == result.sections
    # Section summaries (12 tokens each, more than 80 in all) were combined at least once before the final pass.
    assert max(s.level for s in result.sections) >= 1
    # One fresh cache per section, per group, plus the final one; none ever above the budget.
    assert len(watch.caches) == len(result.sections) + 1
    assert watch.budgets == {48} and max(watch.after) <= 48 and result.peak_slots <= 48
    assert result.evictions == sum(c.evicted for c in watch.caches) > 0
    assert result.tokens_fed == sum(c.seen for c in watch.caches)
    assert isinstance(result.text, str) and result.text


def test_hierarchical_with_one_section_answers_the_instruction_directly(model, tokenizer):
    text = words(40)
    result, watch = run(model, tokenizer, text, strategy="hierarchical", section_tokens=1000)
    single, _ = run(model, tokenizer, text, strategy="single")
    assert result.sections == [] and len(watch.caches) == 1 and result.text == single.text


def test_hierarchical_section_size_defaults_to_the_cache_size(model, tokenizer, document):
    result, _ = run(model, tokenizer, document, strategy="hierarchical", section_max_new_tokens=4)
    level0 = [s for s in result.sections if s.level == 0]
    assert all(s.end - s.start == 48 for s in level0[:-1])


# --- settings and bad input -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"instruction": ""}, "instruction is empty"),
        ({"instruction": "   \n"}, "instruction is empty"),
        ({"instruction": None}, "instruction is empty"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
        ({"max_new_tokens": -5}, "max_new_tokens must be >= 1, got -5"),
        ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number"),
        ({"max_new_tokens": True}, "max_new_tokens must be a whole number"),
        ({"strategy": "magic"}, "unknown strategy 'magic': choose one of single, hierarchical"),
        ({"policy": "lru"}, "unknown policy 'lru'"),
        ({"cache_size": 0}, "cache size must be >= 1"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"chunk_size": 1000}, "cache size 48 \\+ chunk size 1000 exceeds the model's context of 1024"),
        ({"strategy": "hierarchical", "section_tokens": 0}, "section_tokens must be >= 1"),
        ({"strategy": "hierarchical", "section_instruction": ""}, "section_instruction is empty"),
        ({"temperature": -1.0}, "temperature must be a number >= 0"),
        ({"repetition_penalty": 0.5}, "repetition.penalty must be a number >= 1"),
        ({"no_repeat_ngram_size": -1}, "no.repeat.ngram.size must be an integer >= 0"),
        ({"heavy": 60}, "heavy .*cannot exceed the cache size"),
    ],
)
def test_bad_settings_give_one_clear_error_before_any_work(model, tokenizer, kwargs, message):
    watch = BudgetWatch(model)
    try:
        with pytest.raises(H2OStreamError, match=message):
            summarize("Some text to summarize.", (model, tokenizer), **{"cache_size": 48, **kwargs})
    finally:
        watch.close()
    assert watch.after == []  # nothing was fed


@pytest.mark.parametrize(
    "text, message",
    [
        ("", "the document is empty"),
        ("  \n ", "the document is empty"),
        (b"bytes", "expected the document's text or a file path, got bytes"),
    ],
)
def test_bad_text_gives_one_clear_error(model, tokenizer, text, message):
    with pytest.raises(H2OStreamError, match=message):
        summarize(text, (model, tokenizer))


def test_bad_model_argument(tokenizer):
    with pytest.raises(H2OStreamError, match="model must be a model spec, a LoadedModel or a"):
        summarize("Some text.", 42)


def test_a_part_named_options_is_an_unknown_part_checked_before_the_model():
    # `options` is check_settings' own flag (name the settings as the command's options): a part of that name once
    # went there, unchecked, so it failed only after the model was resolved (and renamed the other errors)
    with pytest.raises(H2OStreamError, match="no policy takes options"):
        summarize("Some text.", 42, options=True)
    with pytest.raises(H2OStreamError, match="^max_new_tokens must be >= 1"):
        summarize("Some text.", 42, max_new_tokens=0, options=True)


# --- the real model ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_summarizes_a_20k_token_book_excerpt():
    from h2o_stream.loading.models import load_model

    loaded = load_model(None, threads=1)
    book = load_document("sample", book="Pride and Prejudice").text
    ids = encode(loaded.tokenizer, book)
    start = len(ids) // 10
    excerpt = loaded.tokenizer.decode(ids[start : start + 20_000])
    watch = BudgetWatch(loaded.model)
    began = time.perf_counter()
    try:
        result = summarize(excerpt, loaded, cache_size=512, chunk_size=256, max_new_tokens=48)
    finally:
        watch.close()
    print(f"\n{result.tokens_read} tokens in {time.perf_counter() - began:.0f} s: {result.text!r}")
    assert abs(result.tokens_read - 20_000) < 200  # decode → encode need not round-trip exactly
    assert result.text.strip() and result.tokens_generated > 0
    assert max(watch.after) <= 512 and result.peak_slots == 512 and result.evictions > 0
    assert result.chat_template
