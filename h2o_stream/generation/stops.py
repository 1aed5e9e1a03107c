"""What ends a reply: stop token ids from the tokenizer, the model's generation_config and the chat template.

The chat template's end-of-turn token (`<|im_end|>` for ChatML, `</s>`, `<|eot_id|>`, ...) is found by rendering a
stand-in exchange and looking at the text the template puts after the assistant's content, so no template's token is
written down here.
"""

from __future__ import annotations

from h2o_stream.errors import one_line

# A stand-in exchange for probing templates: only its shape (one user message, one reply) matters.
STAND_IN_USER = "Hello."
STAND_IN_REPLY = "Hi."


class TemplateError(ValueError):
    """The chat template cannot be rendered, or not in the way asked; the message says how."""


def render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    """The chat template applied to `messages` as text ("" for no messages); TemplateError if it fails."""
    if not messages:
        return ""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as error:  # jinja errors, templates that raise on roles they do not support
        raise TemplateError(f"rendering it failed ({one_line(error, 200)})") from error
    if not isinstance(text, str):
        raise TemplateError("rendering it did not give text")
    return text


def suffix(whole: str, prefix: str, what: str) -> str:
    """`whole` minus `prefix`; TemplateError if rendering `what` changed the text before it."""
    if not whole.startswith(prefix):
        raise TemplateError(f"rendering {what} rewrites the text before it")
    return whole[len(prefix) :]


def closing_text(tokenizer, system: str | None = None) -> str:
    """The text the chat template puts after an assistant message's content (e.g. "<|im_end|>\\n"): the rendered
    exchange minus (generation prompt + reply). TemplateError if the template cannot say."""
    asked = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": STAND_IN_USER}]
    prompt = render(tokenizer, asked, generation_prompt=True)
    answered = render(tokenizer, asked + [{"role": "assistant", "content": STAND_IN_REPLY}], generation_prompt=False)
    return suffix(answered, prompt + STAND_IN_REPLY, "a reply")


def end_of_turn_id(tokenizer, closing: str | None = None) -> int | None:
    """The token a reply ends with under the chat template: the first token of `closing` (default: the template's
    `closing_text`) if it is a special or added token, else None (also when there is no usable template)."""
    if closing is None:
        if not getattr(tokenizer, "chat_template", None):
            return None
        try:
            closing = closing_text(tokenizer)
        except TemplateError:
            return None
    ids = tokenizer(closing, add_special_tokens=False)["input_ids"] if closing else []
    if not ids:
        return None
    first = ids[0]
    special = first in set(getattr(tokenizer, "all_special_ids", ()))
    added = tokenizer.convert_ids_to_tokens(first) in getattr(tokenizer, "added_tokens_encoder", {})
    return first if special or added else None


def _ids(value) -> set[int]:
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value or () if v is not None}


def stop_token_ids(tokenizer, model=None, *, chat_template: bool = True) -> set[int]:
    """Every token that ends a reply: the tokenizer's eos, the model's `generation_config.eos_token_id` (an id or a
    list) and, with `chat_template`, the template's end-of-turn token (`end_of_turn_id`)."""
    ids = _ids(getattr(tokenizer, "eos_token_id", None))
    ids |= _ids(getattr(getattr(model, "generation_config", None), "eos_token_id", None))
    if chat_template:
        end = end_of_turn_id(tokenizer)
        if end is not None:
            ids.add(end)
    return ids
