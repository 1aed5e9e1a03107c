"""What the chat tests share: their tokenizer texts and templates, a session factory, state snapshots, the command.

Everything runs offline on the tiny random llama and tiny byte-level BPE tokenizer from conftest.py (with SmolLM2's
chat template, or another, or none), except the tests marked slow, which drive the real default model
(SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import PreTrainedTokenizerFast

from h2o_stream import make_policy
from h2o_stream.apps.chat import ChatSession, Sampling
from support.tiny_models import SMOLLM2_TEMPLATE, bpe_tokenizer

# The machine running these is shared: keep this process (and the ones it starts) to one core.
torch.set_num_threads(1)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "H2O_STREAM_CHAT_HISTORY": ""}

# Zephyr-style, with the BOS written by the template and a different end-of-message token.
ZEPHYR_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + "
    "'\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
# Appends the message count: the rendering of a longer chat does not start with the rendering of a shorter one.
NOT_INCREMENTAL_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}[{{ messages | length }}]"

#: the chat test modules set TRAINING_TEXTS = this, so conftest's `tokenizer` knows these characters
TRAINING_TEXTS = [
    "hello world, what is two plus two? the answer is four.",
    "système ünïcode ✓ 日本語 text",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "user assistant system",
]


def tiny_tokenizer(template: str | None = SMOLLM2_TEMPLATE) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(TRAINING_TEXTS, template)


def session_for(model, tokenizer, *, policy="h2o", size=32, temperature=0.0, max_new_tokens=12, seed=0, **kwargs):
    return ChatSession(
        model,
        tokenizer,
        policy=make_policy(policy, None if policy == "full" else size),
        sampling=Sampling(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed),
        **kwargs,
    )


def session_state(session: ChatSession) -> dict:
    return {
        "cache": [
            {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in layer.items()}
            for layer in session.cache.state()["layers"]
        ],
        "counters": session.counters(),
        "rng": session.generator.get_state(),
        "policy": session.policy,
        "system": session.system,
        "recent": session.recent_messages,
    }


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


def turn_by_turn(fmt, system, users, replies) -> list[int]:
    """The tokens a session feeds: each user turn and each reply as its own piece."""
    pieces = fmt.user_ids(users[0], first=True)
    for user, reply in zip(users[1:], replies, strict=True):
        pieces += fmt.encode(reply) + fmt.closing_ids() + fmt.user_ids(user, first=False)
    return pieces


def full_rendering(tokenizer, system, users, replies) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": users[0]}]
    for user, reply in zip(users[1:], replies, strict=True):
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": user}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


def main_command(*args) -> list[str]:
    return [sys.executable, "-m", "h2o_stream", "chat", *[str(a) for a in args]]


def real_model_available():
    import pytest

    try:
        from h2o_stream.loading.models import load_model  # noqa: F401
    except ImportError as error:
        pytest.skip(f"h2o_stream.loading.models.load_model is not available: {error}")
