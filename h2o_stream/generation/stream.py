"""Incremental detokenizing: transformers' `TextStreamer` with stop strings, and its text collected, not printed.

`TextStreamer` decides when decoded text is final (it holds back a word that a later token may still change, and
the bytes of an unfinished character); `TextStream` adds what a chat needs on top: text that could be the start of
a stop string is held back too, the text is cut where a stop string appears, and a reply's leading whitespace (e.g.
after "Assistant:") is dropped.
"""

from __future__ import annotations

import torch
from transformers import TextStreamer


class TextStream(TextStreamer):
    """Token ids in (`push`, one at a time), final text out. `push` returns the text that became final (maybe "");
    `finish` returns the rest at the end. `stopped` is the stop string that ended the text, or None. `strip_start`:
    drop the text's leading whitespace (a reply's; a text that continues a prompt keeps it)."""

    def __init__(self, tokenizer, stop_strings: tuple[str, ...] = (), *, strip_start: bool = True):
        super().__init__(tokenizer, skip_prompt=False, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.stopped: str | None = None
        self._held = ""  # final text not released yet: it may be the start of a stop string
        self._out: list[str] = []
        self._started = not strip_start  # a text that continues a prompt keeps its leading space

    def push(self, token: int) -> str:
        """Add one token; the text it made final."""
        if self.stopped is None:
            self.put(torch.tensor([token]))
        return self._take()

    def finish(self) -> str:
        """The rest of the text, unfinished word or character and all."""
        if self.stopped is None:
            self.end()
        return self._take()

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        """TextStreamer's hook: `text` is final. Release it, less a possible stop string's start."""
        if self.stopped is not None:
            return
        held = self._held + text
        for stop in self.stop_strings:
            at = held.find(stop)
            if at >= 0:
                self._held, self.stopped = "", stop
                self._release(held[:at])
                return
        keep = (
            0
            if stream_end
            else max(
                (k for stop in self.stop_strings for k in range(1, len(stop)) if held.endswith(stop[:k])), default=0
            )
        )
        self._held = held[len(held) - keep :] if keep else ""
        self._release(held[: len(held) - keep])

    def _release(self, text: str) -> None:
        if not self._started:  # a reply's leading whitespace is not shown
            text = text.lstrip()
            self._started = bool(text)
        if text:
            self._out.append(text)

    def _take(self) -> str:
        text = "".join(self._out)
        self._out.clear()
        return text
