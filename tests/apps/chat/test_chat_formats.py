"""Chat formats: the chat template rendered turn by turn (checked against a full rendering), and the plain fallback."""

from __future__ import annotations

import pytest

from h2o_stream.apps.chat import PlainFormat, TemplateFormat, chat_format
from support.chat_helpers import (  # noqa: F401
    NOT_INCREMENTAL_TEMPLATE,
    TRAINING_TEXTS,
    ZEPHYR_TEMPLATE,
    full_rendering,
    real_model_available,
    session_for,
    tiny_tokenizer,
    turn_by_turn,
)
from support.tiny_models import SMOLLM2_TEMPLATE


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, ZEPHYR_TEMPLATE], ids=["smollm2", "zephyr"])
@pytest.mark.parametrize("system", [None, "Answer in one word."], ids=["default-system", "system"])
def test_turn_pieces_are_the_tokens_of_the_full_rendering(template, system):
    tokenizer = tiny_tokenizer(template)
    fmt = chat_format(tokenizer, system)
    assert isinstance(fmt, TemplateFormat) and fmt.notice is None
    users = ["hello world", "what is two plus two?", "système ✓ 日本語 😀"]
    replies = ["hi there", "four."]
    assert turn_by_turn(fmt, system, users, replies) == full_rendering(tokenizer, system, users, replies)


def test_smollm2_turns_look_as_documented(tokenizer):
    fmt = chat_format(tokenizer, None)
    assert tokenizer.decode(fmt.user_ids("hi", first=False)) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.decode(fmt.closing_ids()) == "<|im_end|>\n"
    first = tokenizer.decode(fmt.user_ids("hi", first=True))
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in fmt.stop_ids
    with_system = tokenizer.decode(chat_format(tokenizer, "Be brief.").user_ids("hi", first=True))
    assert with_system == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_whose_end_of_turn_is_not_the_eos_stops_at_its_own_token():
    """The end-of-turn token is read from the template, not assumed to be the eos or "<|im_end|>"."""
    template = SMOLLM2_TEMPLATE.replace("'<|im_end|>'", "'<|endoftext|>'").replace("<|im_end|>\\n", "<|endoftext|>\\n")
    tokenizer = tiny_tokenizer(template)
    fmt = chat_format(tokenizer, None)
    assert tokenizer.decode(fmt.closing_ids()) == "<|endoftext|>\n"
    assert fmt.stop_ids == {tokenizer.convert_tokens_to_ids("<|endoftext|>"), tokenizer.eos_token_id}
    assert chat_format(tiny_tokenizer(None), None).stop_ids == {tokenizer.eos_token_id}


def test_a_tokenizer_without_a_chat_template_gets_the_plain_format_and_says_so(model):
    tokenizer = tiny_tokenizer(None)
    session = session_for(model, tokenizer, max_new_tokens=8, system="Be brief.")
    assert session.format_kind == "plain" and "no chat template" in session.notice
    for text in ["hello", "world", "two plus two"]:
        session.chat(text)
    assert session.turns == 3 and session.cache.seen == session.prompt_tokens + session.generated_tokens
    first = tokenizer.decode(PlainFormat(tokenizer, "Be brief.").user_ids("hi", first=True))
    assert first == "<|im_start|>Be brief.\n\nUser: hi\nAssistant:"


def test_a_template_that_does_not_render_turn_by_turn_falls_back_with_a_reason(model):
    session = session_for(model, tiny_tokenizer(NOT_INCREMENTAL_TEMPLATE))
    assert session.format_kind == "plain" and "cannot be used turn by turn" in session.notice
    session.chat("hello")


def test_a_template_that_fails_to_render_falls_back(model):
    session = session_for(model, tiny_tokenizer("{{ raise_exception('no system role') }}"), system="x")
    assert session.format_kind == "plain" and "rendering it failed" in session.notice


@pytest.mark.slow
def test_real_tokenizer_turn_pieces_are_the_tokens_of_the_full_rendering():
    real_model_available()
    from h2o_stream.loading.models import load_model

    tokenizer = load_model().tokenizer
    for system in (None, "You are terse."):
        fmt = chat_format(tokenizer, system)
        assert isinstance(fmt, TemplateFormat)
        users, replies = ["Hi there!", "What's 2+2?", "Ünïcode ✓ 日本語 😀\nsecond line"], ["Hello!", "4."]
        assert turn_by_turn(fmt, system, users, replies) == full_rendering(tokenizer, system, users, replies)
        assert tokenizer.decode(fmt.closing_ids()) == "<|im_end|>\n"
        assert tokenizer.convert_tokens_to_ids("<|im_end|>") in fmt.stop_ids
