"""The prompt around a document: the tokenizer's chat template when it has one, else a plain prompt.

With a chat template, the document is the start of a user turn ("Here is a document:\\n" + document) and the
instruction ends that same turn, so the model reads the instruction last, right before the assistant header.
Without one, "Document: ... Instruction: ... Answer:". The document is tokenized on its own with special-token
strings split (a document cannot inject "<|im_end|>"), so the tokens read are exactly the document's.
"""

from __future__ import annotations

from dataclasses import dataclass

DOCUMENT_PREAMBLE = "Here is a document:\n"
SUMMARIES_PREAMBLE = "Here are summaries of consecutive parts of a document, in order:\n"
_CHAT_PLACEHOLDER = "\x00H2O_STREAM_DOCUMENT\x00"


@dataclass
class Prompt:
    """Token ids around the document: prefix + document + suffix (+ response prefix), then generation."""

    prefix: list[int]
    suffix: list[int]
    chat: bool  # whether the tokenizer's chat template was used


def encode(tokenizer, text: str) -> list[int]:
    """`text` as plain content: no special tokens added, special-token strings inside it split like any text."""
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False).input_ids)
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_prompt(
    tokenizer, instruction: str, *, preamble: str = DOCUMENT_PREAMBLE, response_prefix: str = ""
) -> Prompt:
    """The chat template (if any) rendered around a placeholder document and split there; `response_prefix` starts
    the answer (e.g. "The secret passkey is")."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        content = f"{preamble}{_CHAT_PLACEHOLDER}\n\n{instruction}"
        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 - a template that refuses our message (jinja raises anything): use the plain prompt
            rendered = None
        if isinstance(rendered, str) and rendered.count(_CHAT_PLACEHOLDER) == 1:
            head, tail = rendered.split(_CHAT_PLACEHOLDER)
            # Templates put the BOS text in themselves, so nothing is added when tokenizing them.
            prefix = list(tokenizer(head, add_special_tokens=False).input_ids)
            suffix = list(tokenizer(tail + response_prefix, add_special_tokens=False).input_ids)
            return Prompt(prefix=prefix, suffix=suffix, chat=True)
    head = "Document:\n" if preamble == DOCUMENT_PREAMBLE else preamble
    prefix = list(tokenizer(head, add_special_tokens=True).input_ids)  # the tokenizer's BOS, if it adds one
    tail = f"\n\nInstruction: {instruction}\n\nAnswer:" + (f" {response_prefix}" if response_prefix else "")
    return Prompt(prefix=prefix, suffix=encode(tokenizer, tail), chat=False)
