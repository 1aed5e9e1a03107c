"""How chat turns become tokens: the tokenizer's chat template rendered turn by turn, or a plain fallback format.

A session feeds each turn once and never re-renders the history, so a format gives the tokens of one new user
message (`user_ids`), the tokens that close a reply (`closing_ids`), and what ends a reply (`stop_ids`,
`stop_strings`).
"""

from __future__ import annotations

import hashlib

from h2o_stream.errors import H2OStreamError
from h2o_stream.generation import (
    STAND_IN_REPLY,
    STAND_IN_USER,
    TemplateError,
    closing_text,
    end_of_turn_id,
    render,
    stop_token_ids,
    suffix,
)


class ChatFormat:
    """How turns become tokens: `user_ids` for a new user message (the first one also carries the system prompt),
    `closing_ids` after every reply, and what ends a reply (`stop_ids`, `stop_strings`)."""

    kind: str
    notice: str | None = None  # said to the user once (e.g. why the plain format is used)
    stop_strings: tuple[str, ...] = ()

    def __init__(self, tokenizer, system: str | None):
        self.tokenizer = tokenizer
        self.system = system
        self.stop_ids: set[int] = stop_token_ids(tokenizer, chat_template=False)

    def encode(self, text: str) -> list[int]:
        """`text` as token ids, nothing added."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        """The tokens of a new user message, up to where the reply starts."""
        raise NotImplementedError

    def closing_ids(self) -> list[int]:
        """The tokens fed after a reply, so the cache holds a whole message."""
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Identifies the format in a session file: a session resumes only under the same one."""
        raise NotImplementedError


class TemplateFormat(ChatFormat):
    """The tokenizer's chat template, rendered incrementally.

    A new message's text is `render(history + new, generation prompt) - render(history)`, with a stand-in history of
    the same shape (system prompt, one finished exchange): the real history is never kept or re-rendered. The
    constructor checks that the pieces (first turn, reply, closing, next turn) add up to the full rendering of the
    whole conversation, and raises `TemplateError` for templates where they do not.
    """

    kind = "template"

    def __init__(self, tokenizer, system: str | None):
        super().__init__(tokenizer, system)
        self._base = [{"role": "system", "content": system}] if system else []
        self._before_later_turns = self._base + [
            {"role": "user", "content": STAND_IN_USER},
            {"role": "assistant", "content": STAND_IN_REPLY},
        ]
        self._closing = closing_text(tokenizer, system)
        self._closing_ids = self.encode(self._closing)
        end = end_of_turn_id(tokenizer, self._closing)
        if end is not None:
            self.stop_ids.add(end)  # e.g. <|im_end|>: the model ends its reply with it
        self._check_adds_up()

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return render(self.tokenizer, messages, generation_prompt=generation_prompt)

    def user_text(self, text: str, *, first: bool) -> str:
        """The template's text for a new user message (and the assistant header after it)."""
        before = [] if first else self._before_later_turns
        new = (self._base if first else []) + [{"role": "user", "content": text}]
        return suffix(self._render(before + new, True), self._render(before, False), "a user message")

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        try:
            return self.encode(self.user_text(text, first=first))
        except TemplateError as error:
            raise H2OStreamError(f"the chat template cannot render this message: {error}") from None

    def closing_ids(self) -> list[int]:
        return list(self._closing_ids)

    def _check_adds_up(self) -> None:
        u1, a1, u2 = "What is two plus two?", "Four.", "And three plus three?"
        pieces = self.user_text(u1, first=True) + a1 + self._closing + self.user_text(u2, first=False)
        whole = self._render(
            self._base
            + [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}],
            True,
        )
        if pieces != whole:
            raise TemplateError("its turns do not add up to the rendering of the whole conversation")

    def fingerprint(self) -> str:
        return "template:" + hashlib.sha256(str(self.tokenizer.chat_template).encode()).hexdigest()[:16]


class PlainFormat(ChatFormat):
    """For tokenizers without a (usable) chat template: `System\\n\\nUser: ...\\nAssistant: ...\\n` and so on.

    A reply ends at an end-of-sequence token or when the model starts the next "User:" line; that text has then been
    fed already and stays in the cache (harmless, and a reply never shows it).
    """

    kind = "plain"
    stop_strings = ("\nUser:",)

    def __init__(self, tokenizer, system: str | None, notice: str | None = None):
        super().__init__(tokenizer, system)
        self.notice = notice
        bos = getattr(tokenizer, "bos_token_id", None)
        self._bos = [bos] if bos is not None and bos not in self.stop_ids else []

    def user_ids(self, text: str, *, first: bool) -> list[int]:
        prefix = f"{self.system}\n\n" if first and self.system else ""
        return (self._bos if first else []) + self.encode(f"{prefix}User: {text}\nAssistant:")

    def closing_ids(self) -> list[int]:
        return self.encode("\n")

    def fingerprint(self) -> str:
        return "plain"


def chat_format(tokenizer, system: str | None = None) -> ChatFormat:
    """The tokenizer's chat template if it has one that renders incrementally, else the plain format (with a notice
    saying why)."""
    if not getattr(tokenizer, "chat_template", None):
        return PlainFormat(
            tokenizer,
            system,
            "the tokenizer has no chat template; using a plain 'User: ... / Assistant: ...' prompt format",
        )
    try:
        return TemplateFormat(tokenizer, system)
    except TemplateError as error:
        return PlainFormat(
            tokenizer,
            system,
            f"the tokenizer's chat template cannot be used turn by turn ({error}); "
            "using a plain 'User: ... / Assistant: ...' prompt format",
        )
