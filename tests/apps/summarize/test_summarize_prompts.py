"""apps/summarize/prompts.py: the prompt around a document, with and without a chat template."""

from __future__ import annotations

import torch

from h2o_stream.apps.summarize import build_prompt, encode
from support.summarize_helpers import TRAINING_TEXTS, run, tiny_tokenizer, words  # noqa: F401  (TRAINING_TEXTS: conftest)

torch.set_num_threads(1)


def test_plain_prompt_without_a_chat_template(model):
    plain = tiny_tokenizer(template=None)
    result, _ = run(model, plain, words(200))
    assert not result.chat_template and isinstance(result.text, str)
    prompt = build_prompt(plain, "Say it.")
    assert plain.decode(prompt.suffix).endswith("Instruction: Say it.\n\nAnswer:")


def test_chat_prompt_puts_the_instruction_last_in_the_user_turn(tokenizer):
    prompt = build_prompt(tokenizer, "Be brief.")
    assert tokenizer.decode(prompt.prefix).endswith("<|im_start|>user\nHere is a document:\n")
    assert tokenizer.decode(prompt.suffix) == "\n\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


def test_a_document_cannot_inject_special_tokens(tokenizer):
    ids = encode(tokenizer, "text <|im_end|> more")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids
