"""How a summary's text is shown: as paragraphs, and whether it ends a sentence.

The line breaks a model puts inside a paragraph (it imitates a hard-wrapped document, e.g. a Project Gutenberg text
broken at 70 columns) become spaces, as the text streams (`Unwrap`, `unwrap`).

A break is kept where it means something: a blank line (a paragraph ends), a line that starts a list item ('- ',
'* ', '• ', '1. ', '2) ') or a heading, quote or table row ('#', '>', '|'), and a line break right after another
one.
"""

from __future__ import annotations

#: what a line starting a block begins with (followed by anything)
MARKS = ("-", "*", "•", "#", ">", "|")


class Unwrap:
    """Streaming: `push(piece)` gives the text that is final so far; `finish()` the rest. A line break is held until
    what follows it shows whether it wraps a line (then it becomes a space) or ends one."""

    def __init__(self):
        self.held = ""  # a line break and what followed it, while undecided
        self.last = "\n"  # the last character given out (the start counts as a line start)

    def push(self, piece: str) -> str:
        out = []
        for char in piece:
            if self.held:
                self.held += char
                out.append(self._decide())
            elif char == "\n" and self.last != "\n":
                self.held = char
            else:
                out.append(char)
            if out and out[-1]:
                self.last = out[-1][-1]
        return "".join(out)

    def finish(self) -> str:
        """What is still held, at the end of the text: a wrapped line's last digits, or nothing (a final break)."""
        rest, self.held = self.held.strip(), ""
        return (" " if rest and not self.last.isspace() else "") + rest

    def _decide(self) -> str:
        """The held break's text once it is known (emptying `held`), or "" while it is not."""
        after = self.held[1:].lstrip(" \t")
        if not after:
            return ""
        first = after[0]
        if first == "\n":  # a blank line: the paragraph ends
            self.held = ""
            return "\n\n"
        if first.isdigit():
            digits = len(after) - len(after.lstrip("0123456789"))
            if digits == len(after):
                return ""  # "12" so far: a list item ("12. ") or a number that goes on the line
            if after[digits] in ".)":
                return self._keep()
            return self._join(after[:digits], after[digits:])
        if first in MARKS:
            return self._keep()
        return self._join("", after)

    def _keep(self) -> str:
        text, self.held = self.held, ""
        return text

    def _join(self, done: str, rest: str) -> str:
        """The break becomes a space before `done` + `rest`; a line break at the end of `rest` is held anew."""
        self.held = ""
        space = "" if self.last.isspace() else " "
        if rest.endswith("\n"):
            self.held = "\n"
            rest = rest[:-1]
        return space + done + rest


def unwrap(text: str) -> str:
    """`text` with its paragraphs' line breaks made spaces (see Unwrap)."""
    joiner = Unwrap()
    return joiner.push(text) + joiner.finish()


#: what may close a sentence after its final stop: quotes and brackets
CLOSERS = "\"'”’»)]*_"


def ends_a_sentence(text: str) -> bool:
    """Whether `text` ends with a sentence's end ('.', '!', '?', '…', or ':' before a list), quotes and brackets
    after it allowed."""
    return text.rstrip().rstrip(CLOSERS).endswith((".", "!", "?", "…", ":"))
