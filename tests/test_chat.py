"""ChatSession and `h2o-stream chat`.

Everything runs offline on a tiny random llama with a tiny byte-level BPE tokenizer built here (with SmolLM2's chat
template, or none), except the tests marked slow, which drive the real default model (SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import PreTrainedTokenizerFast

from h2o_stream import H2OStreamError, make_policy
from h2o_stream.apps.chat.session import _digest, ChatSession, PlainFormat, Sampling, TemplateFormat, TextStream, chat_format, sample_token
from h2o_stream.cli.chat import chat
from h2o_stream.engine.feed import feed
from tiny_models import SMOLLM2_TEMPLATE, bpe_tokenizer, tiny_llama

# The machine running these is shared: keep this process (and the ones it starts) to one core.
torch.set_num_threads(1)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "H2O_STREAM_CHAT_HISTORY": ""}

# Zephyr-style, with the BOS written by the template and a different end-of-message token.
ZEPHYR_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")
# Appends the message count: the rendering of a longer chat does not start with the rendering of a shorter one.
NOT_INCREMENTAL_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}[{{ messages | length }}]"

TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.", "système ünïcode ✓ 日本語 text",
          "You are a helpful AI assistant named SmolLM, trained by Hugging Face", "user assistant system"]


def tiny_tokenizer(template: str | None = SMOLLM2_TEMPLATE) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(TRAINING_TEXTS, template)




def session_for(model, tokenizer, *, policy="h2o", size=32, temperature=0.0, max_new_tokens=12, seed=0, **kwargs):
    return ChatSession(model, tokenizer, policy=make_policy(policy, None if policy == "full" else size),
                       sampling=Sampling(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed),
                       **kwargs)


def session_state(session: ChatSession) -> dict:
    return {"cache": [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in layer.items()}
                      for layer in session.cache.state()["layers"]],
            "counters": session._counters(), "rng": session._generator.get_state(), "policy": session.policy,
            "system": session.system, "recent": session.recent_messages}


def assert_same_state(a: dict, b: dict) -> None:
    assert a["counters"] == b["counters"] and a["policy"] == b["policy"] and a["system"] == b["system"]
    assert a["recent"] == b["recent"] and torch.equal(a["rng"], b["rng"])
    for la, lb in zip(a["cache"], b["cache"], strict=True):
        assert la.keys() == lb.keys()
        for key in la:
            if isinstance(la[key], torch.Tensor):
                assert torch.equal(la[key], lb[key]), key
            else:
                assert la[key] == lb[key], key


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


# --- the chat template, turn by turn --------------------------------------------------------------------------------


def turn_by_turn(fmt, system, users, replies) -> list[int]:
    """The tokens a session feeds: each user turn and each reply as its own piece."""
    pieces = fmt.user_ids(users[0], first=True)
    for user, reply in zip(users[1:], replies):
        pieces += fmt.encode(reply) + fmt.closing_ids() + fmt.user_ids(user, first=False)
    return pieces


def full_rendering(tokenizer, system, users, replies) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": users[0]}]
    for user, reply in zip(users[1:], replies):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


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
    assert tokenizer.decode(fmt.user_ids("hi", first=False)) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(fmt.closing_ids()) == "<|im_end|>\n"
    first = tokenizer.decode(fmt.user_ids("hi", first=True))
    assert first.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in fmt.stop_ids
    with_system = tokenizer.decode(chat_format(tokenizer, "Be brief.").user_ids("hi", first=True))
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


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
    expected = model.generate(prompt, max_new_tokens=8, do_sample=False, eos_token_id=sorted(fmt.stop_ids),
                              pad_token_id=2)[0, prompt.shape[1]:].tolist()
    assert third.token_ids == [t for t in expected if t not in fmt.stop_ids][:len(third.token_ids)]
    assert len(third.token_ids) == len([t for t in expected if t not in fmt.stop_ids])


# --- budget -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["h2o", "sink", "window"])
def test_cache_never_exceeds_the_budget_across_many_turns(model, tokenizer, policy):
    budget = 24
    session = session_for(model, tokenizer, policy=policy, size=budget, temperature=1.0, max_new_tokens=10,
                          chunk_size=8)
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


# --- save / load ----------------------------------------------------------------------------------------------------


def test_save_then_load_gives_identical_next_token_logits_and_replies(model, tokenizer, tmp_path):
    original = session_for(model, tokenizer, temperature=1.0, seed=7, system="Be brief.")
    for text in ["hello world", "what is two plus two?", "the answer is four."]:
        original.chat(text)
    path = original.save(tmp_path / "chat.pt")
    # a new model object with the same weights, a session with other settings: load takes the saved ones
    other_model = tiny_llama(len(tokenizer))
    resumed = ChatSession(other_model, tokenizer, policy=make_policy("sink", 64), sampling=Sampling(seed=1))
    resumed.load(path)
    assert resumed.policy == original.policy and resumed.system == "Be brief." and resumed.turns == 3
    assert resumed.sampling == original.sampling and resumed.stats()["tokens_seen"] == original.stats()["tokens_seen"]
    assert resumed.recent_messages == original.recent_messages

    a, b = original.chat("once more"), resumed.chat("once more")  # sampled: the RNG state came along too
    assert a.token_ids == b.token_ids and a.text == b.text
    probe = torch.tensor([chat_format(tokenizer, "Be brief.").user_ids("and again", first=False)])
    assert torch.equal(feed(model, original.cache, probe, 4), feed(other_model, resumed.cache, probe, 4))
    assert a.token_ids == b.token_ids and a.text == b.text


def test_save_is_atomic_and_refuses_bad_paths(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer)
    session.chat("hello")
    with pytest.raises(H2OStreamError, match="does not exist"):
        session.save(tmp_path / "missing" / "chat.pt")
    with pytest.raises(H2OStreamError, match="is a directory"):
        session.save(tmp_path)
    session.save(tmp_path / "chat.pt")
    session.save(tmp_path / "chat.pt")  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chat.pt"]  # no temporary files left behind


@pytest.fixture
def saved(model, tokenizer, tmp_path):
    session = session_for(model, tokenizer)
    session.chat("hello world")
    return session.save(tmp_path / "chat.pt")


def resave(state: dict, path: Path) -> None:
    """As a session file written by a buggy or other h2o-stream would be: well-formed, with a valid checksum."""
    state.pop("digest", None)
    state["digest"] = _digest(state)
    torch.save(state, path)


def corrupt_variants(saved: Path, tmp_path: Path, tokenizer):
    data = saved.read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.pt").write_bytes(b"not a session at all\n" * 10)
    flipped = bytearray(data)
    for i in range(len(flipped) // 3, len(flipped) // 3 + 64):
        flipped[i] ^= 0xFF
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    torch.save({"some": "dict"}, tmp_path / "other.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    state = torch.load(saved, weights_only=True)
    state["cache"]["layers"][0]["keys"] = state["cache"]["layers"][0]["keys"][:, :1]
    resave(state, tmp_path / "bad-shapes.pt")
    state = torch.load(saved, weights_only=True)
    state["version"] = 99
    resave(state, tmp_path / "future.pt")
    state = torch.load(saved, weights_only=True)
    del state["counters"]["turns"]
    resave(state, tmp_path / "no-counter.pt")
    state = torch.load(saved, weights_only=True)
    state["cache"]["layers"][1]["scores"][0, 0, 0] += 1
    torch.save(state, tmp_path / "edited.pt")  # edited without updating its checksum
    return {
        "missing.pt": "no session file",
        "truncated.pt": "not a readable chat session",
        "garbage.pt": "not a readable chat session",
        "flipped.pt": "not a readable chat session|damaged chat session",
        "other.pt": "not an h2o-stream chat session",
        "tensor.pt": "not an h2o-stream chat session",
        "bad-shapes.pt": "not a usable chat session",
        "future.pt": "format version 99",
        "no-counter.pt": "not a usable chat session",
        "edited.pt": "damaged chat session",
        ".": "is a directory",
    }


def test_load_refuses_missing_corrupt_and_foreign_files_and_leaves_the_session_alone(model, tokenizer, saved,
                                                                                     tmp_path):
    session = session_for(model, tokenizer, policy="sink", size=16)
    session.chat("what is two plus two?")
    before = session_state(session)
    for name, message in corrupt_variants(saved, tmp_path, tokenizer).items():
        with pytest.raises(H2OStreamError, match=message):
            session.load(tmp_path / name)
        assert_same_state(session_state(session), before)
    # the session still works, and a good file still loads
    session.chat("hello")
    session.load(saved)
    assert session.turns == 1 and session.policy.name == "h2o"


def test_load_refuses_another_models_session(tokenizer, saved):
    for other, message in [(tiny_llama(len(tokenizer), seed=1), "another model"),  # same shape, other weights
                           (tiny_llama(len(tokenizer), layers=3), "another model"),
                           (tiny_llama(len(tokenizer), dtype=torch.bfloat16), "--dtype float32")]:
        session = session_for(other, tokenizer)
        session.chat("hello")
        before = session_state(session)
        with pytest.raises(H2OStreamError, match=message):
            session.load(saved)
        assert_same_state(session_state(session), before)


def test_load_refuses_a_session_of_another_chat_format(model, saved):
    session = session_for(model, tiny_tokenizer(None))
    with pytest.raises(H2OStreamError, match="different chat format"):
        session.load(saved)


# --- bad input, fallbacks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_an_empty_message_is_refused_and_changes_nothing(model, tokenizer, text):
    session = session_for(model, tokenizer)
    session.chat("hello")
    before = session_state(session)
    with pytest.raises(H2OStreamError, match="empty"):
        session.send(text)
    assert_same_state(session_state(session), before)


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


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top-p"), (dict(top_p=1.5), "top-p"),
    (dict(max_new_tokens=0), "max-new-tokens"), (dict(seed=-3), "seed")])
def test_bad_sampling_settings(kwargs, message):
    with pytest.raises(H2OStreamError, match=message):
        Sampling(**kwargs)


# --- decoding and sampling ------------------------------------------------------------------------------------------


def test_text_streams_whole_characters_only(tokenizer):
    text = "système ✓ 日本語 😀 €!"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert any("\ufffd" in tokenizer.decode([token]) for token in ids)  # some characters span several tokens
    stream = TextStream(tokenizer)
    deltas = [stream.push(token)[0] for token in ids] + [stream.finish()]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)


def test_text_stream_holds_back_and_cuts_at_a_stop_string(tokenizer):
    stream = TextStream(tokenizer, ("\nUser:",))
    out, stopped = [], False
    for token in tokenizer("four.\nUsers\nUser: more", add_special_tokens=False)["input_ids"]:
        delta, stopped = stream.push(token)
        out.append(delta)
        if stopped:
            break
    assert stopped and "".join(out) == "four.\nUsers"


def test_greedy_top_p_and_seeded_sampling():
    logits = torch.tensor([0.0, 3.0, 1.0, 2.9])
    generator = torch.Generator().manual_seed(0)
    assert sample_token(logits, Sampling(temperature=0), generator) == 1
    assert {sample_token(logits, Sampling(temperature=1, top_p=0.01), generator) for _ in range(20)} == {1}
    assert {sample_token(logits, Sampling(temperature=5, top_p=1), generator) for _ in range(200)} == {0, 1, 2, 3}
    draws = [[sample_token(logits, Sampling(temperature=1), torch.Generator().manual_seed(s)) for s in range(30)]
             for _ in range(2)]
    assert draws[0] == draws[1]


def test_streamed_text_is_the_reply(model, tokenizer):
    session = session_for(model, tokenizer, temperature=1.0, max_new_tokens=30)
    deltas = list(session.send("hello world"))
    assert "".join(deltas) == session.last_turn.text.lstrip() and len(deltas) > 1


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
    for action in (lambda: session.chat("again"), session.reset, lambda: session.save(tmp_path / "s.pt"),
                   lambda: session.load(tmp_path / "s.pt")):
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


# --- the command line, piped ----------------------------------------------------------------------------------------




def run_chat(args, stdin, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    return CliRunner().invoke(chat, [str(a) for a in args], input=stdin)


def test_piped_turns_and_commands(model_dir, tmp_path, monkeypatch):
    stdin = "\n".join(["hello", "", "   ", "/stats", "/nosuch", "what is two plus two?", "/save", f"/save {tmp_path}/s.pt",
                       "/load", f"/load {tmp_path}/missing.pt", f"/load {tmp_path}/s.pt", "/help", "/reset", "/stats",
                       "/exit", "never read"]) + "\n"
    result = run_chat(["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 5, "--seed", 1], stdin,
                      monkeypatch)
    out, err = result.stdout, result.stderr
    assert result.exit_code == 1, (out, err)  # piped, and some commands failed
    assert "cache occupancy: 16/16" in out and "turns:           2" not in out
    assert "unknown command /nosuch; type /help" in err
    assert "/save needs a file name" in err and "/load needs a file name" in err
    assert "no session file at" in err
    assert "saved the session (turn 2" in out and "resumed the session from" in out
    assert "/stats" in out and "session reset: 2 turn(s) forgotten" in out
    assert "turns:           0" in out
    assert err.count("[reply cut at --max-new-tokens 5]") == 2  # the two messages, not the empty lines or /exit
    assert (tmp_path / "s.pt").is_file()


def test_piped_session_without_failures_exits_zero(model_dir, monkeypatch):
    # Greedy, so the replies are the same on every run (sampled ones could hold newlines or stop early).
    result = run_chat(["--model", model_dir, "--max-new-tokens", 3, "--temperature", 0],
                      "hello\n//slash is a message\n", monkeypatch)
    assert result.exit_code == 0, result.output
    assert "unknown command" not in result.stderr
    assert result.stderr.count("[reply cut at --max-new-tokens 3]") == 2  # "//..." was sent as a message


def test_plain_format_notice_on_the_command_line(model, tmp_path, monkeypatch):
    directory = tmp_path / "plain"
    model.save_pretrained(directory)
    tiny_tokenizer(None).save_pretrained(directory)
    result = run_chat(["--model", directory, "--max-new-tokens", 3], "hello\n", monkeypatch)
    assert result.exit_code == 0 and "note: the tokenizer has no chat template" in result.stderr


@pytest.mark.parametrize("args, message", [(["--cache-size", "big"], "--cache-size must be a whole number"),
                                           (["--policy", "nope"], "unknown policy"),
                                           (["--top-p", "0"], "top-p")])
def test_bad_options(model_dir, args, message, monkeypatch):
    result = run_chat(["--model", model_dir, *args], "", monkeypatch)
    assert result.exit_code != 0
    assert message in (result.output + str(result.exception))


def main_command(*args) -> list[str]:
    return [sys.executable, "-m", "h2o_stream", "chat", *[str(a) for a in args]]


def test_a_session_saved_by_one_process_continues_in_another(model_dir, tmp_path):
    """Sampled, not greedy: the RNG state travels too. Process A: 2 turns, save, third turn. Process B: load, the
    same third turn gives the same reply."""
    common = ["--model", model_dir, "--cache-size", 16, "--max-new-tokens", 8, "--temperature", 1.0, "--threads", 1]
    path = tmp_path / "s.pt"
    a = subprocess.run(main_command(*common, "--seed", 5), input=f"hello\nworld\n/save {path}\nthird turn\n",
                       capture_output=True, text=True, env=ONE_THREAD, timeout=120)
    b = subprocess.run(main_command(*common, "--seed", 99, "--load", path), input="third turn\n", capture_output=True,
                       text=True, env=ONE_THREAD, timeout=120)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    assert "resumed the session" in b.stderr
    reply_a = a.stdout.split("saved the session")[1].split("\n", 1)[1]
    assert reply_a.strip() and b.stdout == reply_a


def test_a_bad_session_on_the_command_line_is_one_error_line(model_dir, tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"junk")
    result = subprocess.run(main_command("--model", model_dir, "--load", tmp_path / "bad.pt"), input="",
                            capture_output=True, text=True, env=ONE_THREAD, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith(f"Error: {tmp_path / 'bad.pt'} is not a readable chat")


# --- the command line in a terminal ---------------------------------------------------------------------------------


def spawn(args, timeout=120):
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, main_command(*args)[1:], env=ONE_THREAD, encoding="utf-8",
                          timeout=timeout, dimensions=(40, 200))
    return child


def test_terminal_ctrl_c_stops_a_reply_and_ctrl_d_exits(model_dir):
    child = spawn(["--model", model_dir, "--max-new-tokens", 100000, "--temperature", 0])
    try:
        child.expect_exact(">>> ")
        child.sendline("hello world")
        child.expect_exact("hello world\r\n")
        child.expect(r"\S")  # the reply is streaming
        time.sleep(0.5)
        child.sendintr()
        child.expect_exact("[stopped after")
        child.expect_exact(">>> ")
        child.sendline("/stats")
        child.expect(r"turns:\s+1")
        child.expect_exact(">>> ")
        # Ctrl-C at the prompt must not end the session. (Whether a fresh prompt is printed depends on where the
        # signal lands; once in a loaded CI run none came, so only survival is asserted here.)
        child.sendintr()
        time.sleep(0.3)
        child.sendeof()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


def pexpect_eof():
    import pexpect

    return pexpect.EOF


# --- the real default model ---------------------------------------------------------------------------------------


def real_model_available():
    try:
        from h2o_stream.loading.models import load_model  # noqa: F401
    except ImportError as error:
        pytest.skip(f"h2o_stream.loading.models.load_model is not available: {error}")


def read_reply(child, prompt=">>> "):
    """Everything up to the next prompt, as the chunks it arrived in."""
    chunks, text = [], ""
    deadline = time.monotonic() + 120
    while not text.endswith(prompt):
        if time.monotonic() > deadline:
            raise AssertionError(f"no prompt after: {text!r}")
        try:
            chunk = child.read_nonblocking(4096, timeout=1)
        except Exception as error:
            if type(error).__name__ == "TIMEOUT":
                continue
            raise
        chunks.append((time.monotonic(), chunk))
        text += chunk
    return text[: -len(prompt)], chunks


@pytest.mark.slow
def test_real_model_in_a_terminal_three_turns_stats_save_and_resume_in_a_new_process(tmp_path):
    real_model_available()
    args = ["--temperature", 0, "--max-new-tokens", 24, "--cache-size", 64, "--threads", 1]
    path = tmp_path / "session.pt"
    child = spawn(args, timeout=300)
    try:
        child.expect_exact(">>> ", timeout=300)
        for question in ["What is the capital of France?", "And of Italy?", "Name a famous painter from there."]:
            child.sendline(question)
            child.expect_exact(question + "\r\n")  # the terminal's echo
            reply, chunks = read_reply(child)
            assert re.search(r"[A-Za-z]{2}", reply), reply
            assert len(chunks) > 1 and chunks[-1][0] - chunks[0][0] > 0.05, "the reply did not stream"
        child.sendline("/stats")
        stats, _ = read_reply(child)
        occupancy = re.search(r"cache occupancy: (\d+)/(\d+)", stats)
        assert occupancy and int(occupancy[1]) <= int(occupancy[2]) == 64, stats
        assert re.search(r"turns:\s+3", stats) and re.search(r"evictions:\s+[1-9]", stats), stats
        seen = re.search(r"tokens seen:\s+(\d+)", stats)[1]
        child.sendline(f"/save {path}")
        saved, _ = read_reply(child)
        assert "saved the session (turn 3" in saved
        child.sendline("Tell me one more thing.")
        child.expect_exact("Tell me one more thing.\r\n")
        fourth, _ = read_reply(child)
        child.sendline("/exit")
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0

    child = spawn(args, timeout=300)
    try:
        child.expect_exact(">>> ", timeout=300)
        child.sendline(f"/load {path}")
        loaded, _ = read_reply(child)
        assert "resumed the session" in loaded and "3 turn(s)" in loaded and f"{seen} tokens seen" in loaded
        child.sendline("Tell me one more thing.")
        child.expect_exact("Tell me one more thing.\r\n")
        again, _ = read_reply(child)
        assert again == fourth  # greedy: the same session gives the same next reply
        child.sendeof()
        child.expect(pexpect_eof())
    finally:
        child.close(force=True)
    assert child.exitstatus == 0


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
