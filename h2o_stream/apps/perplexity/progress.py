"""Progress bars of a sweep's runs: one per run in progress, named by the run (policy-cache size), each on its own
line, with notes printed above them.

One process draws them all. A sweep's workers send their progress to the parent (`SentBars`), which draws it
(`Bars`), so that no two processes redraw the same terminal line. Bars show only on a terminal (tqdm's disable=None);
TQDM_DISABLE=1 turns them off.
"""

from __future__ import annotations

import sys
import time
from typing import Protocol

from tqdm import tqdm

#: a worker sends a run's progress at most this often (and always at its end)
SEND_EVERY_S = 0.5


class Progress(Protocol):
    """Where a run's progress goes: `Bars` (drawn here) or `SentBars` (sent to the process that draws them)."""

    def update(self, name: str, position: int, total: int, postfix: str | None = None) -> None: ...

    def finish(self, name: str) -> None: ...


class Bars:
    """The bars of the runs in progress in this process, by run name. `leave`: a finished run's bar stays on the
    screen (one process running one run after another); off when several draw at once, whose lines move up as
    others finish."""

    def __init__(self, *, leave: bool = True, file=None):
        self.leave, self.file = leave, file
        self.bars: dict[str, tqdm] = {}

    def update(self, name: str, position: int, total: int, postfix: str | None = None) -> None:
        """Run `name` is at stream token `position` of `total`; `postfix` (e.g. its running perplexity) follows."""
        done = min(position, total)
        bar = self.bars.get(name)
        if bar is None:
            bar = self.bars[name] = tqdm(
                total=total,
                initial=done,
                desc=name,
                unit="tok",
                unit_scale=True,
                dynamic_ncols=True,
                disable=None,
                leave=self.leave,
                postfix=postfix,
                file=self.file or sys.stderr,
            )
        elif postfix:
            bar.set_postfix_str(postfix, refresh=False)
        bar.update(done - bar.n)

    def finish(self, name: str) -> None:
        bar = self.bars.pop(name, None)
        if bar is not None:
            bar.close()

    def note(self, write, text: str) -> None:
        """`write(text)` (a line to the same terminal) with the bars cleared first and redrawn below it."""
        with tqdm.external_write_mode(file=self.file or sys.stderr):
            write(text)

    def close(self) -> None:
        for name in list(self.bars):
            self.finish(name)


class SentBars:
    """`Bars`' interface in a worker: each update goes to the parent as an event (`index`, "progress", (name,
    position, total, postfix)) on `events`, at most every SEND_EVERY_S per run; `finish` as (index, "finished",
    name)."""

    def __init__(self, events, index: int):
        self.events, self.index = events, index
        self.sent: dict[str, float] = {}  # run name -> when its progress was last sent (time.monotonic)

    def update(self, name: str, position: int, total: int, postfix: str | None = None) -> None:
        now = time.monotonic()
        if position < total and now - self.sent.get(name, float("-inf")) < SEND_EVERY_S:
            return
        self.sent[name] = now
        self.events.put((self.index, "progress", (name, position, total, postfix)))

    def finish(self, name: str) -> None:
        self.sent.pop(name, None)
        self.events.put((self.index, "finished", name))
