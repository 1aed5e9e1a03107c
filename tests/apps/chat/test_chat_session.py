"""ChatSession: what it feeds, the budget across many turns, streaming, stopping, cancelling, failing, reset."""

from __future__ import annotations

import pytest
import torch

from h2o_stream import H2OStreamError
from h2o_stream.apps.chat import CHAT_SAMPLING, ChatSession, chat_format
from support.chat_helpers import TRAINING_TEXTS, assert_same_state, session_for, session_state  # noqa: F401
from support.tiny_models import tiny_llama


def record_forwards(model):
    """input_ids of every forward pass, and the largest cache occupancy seen before any of them."""
    log = {"ids": [], "max_slots_before": 0}

    def hook(module, args, kwargs):
        cache = kwargs.get("cache")
        if cache is not None:
            log["max_slots_before"] = max(log["max_slots_before"], max(layer.slots for layer in cache.layers))
        ids = kwargs.get("input_ids", args[0] if args else None)
        log["ids"].extend(ids[0].tolist())

    return log, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_session_feeds_the_template_tokens_and_the_reply_and_nothing_else(model, tokenizer):
    session = session_for(model, tokenizer, policy="full", max_new_tokens=6)
    fmt = chat_format(tokenizer, None)
    log, hook = record_forwards(model)
    try:
        expected = []
        for i, text in enumerate(["hello world", "what is two plus two?", "four"]):
            result = session.chat(text)
            expected += fmt.user_ids(text, first=i == 0) + result.token_ids + fmt.closing_ids()
    finally:
        hook.remove()
    assert log["ids"] == expected
    assert session.cache.seen == len(expected) == session.prompt_tokens + session.generated_tokens


def test_incremental_turns_give_the_reply_a_full_recompute_gives(tokenizer):
    """With nothing evicted, turn 3's greedy reply equals plain transformers' greedy decode of the whole conversation
    re-encoded from scratch: the cache holds exactly what the history would."""
    model = tiny_llama(len(tokenizer), seed=3)
    session = session_for(model, tokenizer, policy="full", max_new_tokens=8, chunk_size=5)
    fmt = chat_format(tokenizer, None)
    history = []
    for i, text in enumerate(["hello world", "what is two plus two?"]):
        history += fmt.user_ids(text, first=i == 0) + session.chat(text).token_ids + fmt.closing_ids()
    third = session.chat("the answer is four.")
    prompt = torch.tensor([history + fmt.user_ids("the answer is four.", first=False)])
    expected = model.generate(
        prompt, max_new_tokens=8, do_sample=False, eos_token_id=sorted(fmt.stop_ids), pad_token_id=2
    )[0, prompt.shape[1] :].tolist()
    assert third.token_ids == [t for t in expected if t not in fmt.stop_ids][: len(third.token_ids)]
    assert len(third.token_ids) == len([t for t in expected if t not in fmt.stop_ids])


# knorm and random are policies of one score() each
@pytest.mark.parametrize("policy", ["h2o", "sink", "window", "knorm", "random"])
def test_cache_never_exceeds_the_budget_across_many_turns(model, tokenizer, policy):
    budget = 24
    session = session_for(
        model, tokenizer, policy=policy, size=budget, temperature=1.0, max_new_tokens=10, chunk_size=8
    )
    log, hook = record_forwards(model)
    try:
        for turn in range(25):
            words = 3 * budget if turn == 7 else 1 + (turn * 7) % 13  # turn 7 alone is longer than the budget
            result = session.chat(" ".join(["hello", "world"] * words))
            if turn == 7:
                assert result.prompt_tokens > 3 * budget
            assert max(layer.slots for layer in session.cache.layers) <= budget
            assert session.cache.seen == session.prompt_tokens + session.generated_tokens
    finally:
        hook.remove()
    assert log["max_slots_before"] == budget  # between forward passes the cache is always within the budget
    stats = session.stats()
    assert stats["turns"] == 25 and stats["cache_slots"] == budget == stats["cache_budget"]
    assert stats["evicted"] > 0 and stats["tokens_seen"] > 10 * budget and stats["rss_bytes"] > 0


def test_a_session_samples_with_the_chat_defaults_unless_told_otherwise(model, tokenizer):
    sampling = ChatSession(model, tokenizer).sampling
    assert {k: getattr(sampling, k) for k in CHAT_SAMPLING} == CHAT_SAMPLING
    assert sampling.repetition_penalty > 1 and not sampling.greedy  # the defaults guard against loops
    assert ChatSession(model, tokenizer).sampling.seed != sampling.seed  # a random seed each time


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_an_empty_message_is_refused_and_changes_nothing(model, tokenizer, text):
    session = session_for(model, tokenizer)
    session.chat("hello")
    before = session_state(session)
    with pytest.raises(H2OStreamError, match="empty"):
        session.send(text)
    assert_same_state(session_state(session), before)


def test_streamed_text_is_the_reply(model, tokenizer):
    session = session_for(model, tokenizer, temperature=1.0, max_new_tokens=30)
    deltas = list(session.send("hello world"))
    assert "".join(deltas) == session.last_turn.text.lstrip() and len(deltas) > 1
    assert session.last_turn.text == tokenizer.decode(session.last_turn.token_ids, skip_special_tokens=True).lstrip()


def test_a_plain_format_reply_stops_at_the_next_user_line_and_does_not_show_it(model):
    from support.chat_helpers import tiny_tokenizer

    tokenizer = tiny_tokenizer(None)
    session = session_for(model, tokenizer, max_new_tokens=40)
    assert session.format.stop_strings == ("\nUser:",)
    session.format.stop_strings = ("o",)  # a stop text the random model is sure to produce
    result = session.chat("hello world")
    assert result.stop_reason == "end" and "o" not in result.text and result.generated_tokens < 40
    assert "o" in tokenizer.decode(result.token_ids)  # ended by the stop text, which the reply does not show
    assert session.cache.seen == session.prompt_tokens + session.generated_tokens


# --- stopping, cancelling, failing ------------------------------------------------------------------------------


def test_stopping_a_reply_keeps_it_and_closes_the_message(model, tokenizer):
    session = session_for(model, tokenizer, max_new_tokens=50)
    polls = iter(range(1000))
    result = session.chat("hello world", should_stop=lambda: next(polls) >= 5)  # 4 prompt chunks... then stop
    assert result.stop_reason == "interrupted" and 0 < result.generated_tokens < 50
    assert session.turns == 1 and session.cache.seen == session.prompt_tokens + session.generated_tokens
    session.chat("again")
    assert session.turns == 2


def test_closing_the_generator_early_keeps_what_was_said(model, tokenizer):
    session = session_for(model, tokenizer, temperature=1.0, max_new_tokens=50)
    stream = session.send("hello world")
    next(stream), next(stream)
    stream.close()
    assert session.last_turn.stop_reason == "interrupted" and session.turns == 1
    assert session.cache.seen == session.prompt_tokens + session.generated_tokens


def test_nothing_else_runs_while_a_reply_is_under_way(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer, temperature=1.0, max_new_tokens=50)
    stream = session.send("hello world")
    next(stream)
    for action in (
        lambda: session.chat("again"),
        session.reset,
        lambda: session.save(tmp_path / "s.pt"),
        lambda: session.load(tmp_path / "s.pt"),
    ):
        with pytest.raises(H2OStreamError, match="while a reply is being generated"):
            action()
    list(stream)
    session.chat("again")
    assert session.turns == 2


def test_stopping_while_the_message_is_read_cancels_the_turn(model, tokenizer):
    session = session_for(model, tokenizer, chunk_size=4)
    session.chat("hello")
    before = session_state(session)
    polls = iter(range(1000))
    result = session.chat("hello world " * 10, should_stop=lambda: next(polls) >= 2)
    assert result.stop_reason == "cancelled"
    assert_same_state(session_state(session), before)


def test_an_error_inside_a_forward_pass_restores_the_session(tokenizer, monkeypatch):
    model = tiny_llama(len(tokenizer))
    session = session_for(model, tokenizer, size=16)
    session.chat("hello world " * 5)
    before = session_state(session)
    layer = model.model.layers[1].self_attn
    calls = {"n": 0}

    def fail_sometimes(module, args):
        calls["n"] += 1
        if calls["n"] == 4:  # mid-turn, after layer 0 of this forward has already updated its cache
            raise RuntimeError("boom")

    hook = layer.register_forward_pre_hook(fail_sometimes)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            session.chat("what is two plus two?")
    finally:
        hook.remove()
    assert_same_state(session_state(session), before)
    session.chat("what is two plus two?")
    assert session.turns == 2


def test_reset_forgets_the_conversation_but_keeps_the_settings(model, tokenizer):
    session = session_for(model, tokenizer, system="Be brief.")
    first = session.chat("hello").token_ids
    session.chat("more")
    session.reset()
    assert session.turns == 0 and session.cache.seen == 0 and session.system == "Be brief."
    assert session.chat("hello").token_ids == first
