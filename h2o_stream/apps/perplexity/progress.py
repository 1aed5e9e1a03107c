"""Progress of a sweep's runs: one bar per run in progress on a terminal, named by the run (policy-cache size), or
plain lines where stderr is not a terminal (`h2o_stream.apps.progress.Bars`).

One process shows them all. A sweep's workers send their progress to the parent (`SentBars`), which shows it
(`Bars`), so that no two processes redraw the same terminal line and the lines of a log come from one clock.
"""

from __future__ import annotations

import time
from typing import Protocol

from h2o_stream.apps.progress import Bars

__all__ = ["SEND_EVERY_S", "Bars", "Progress", "SentBars"]

#: a worker sends a run's progress at most this often (and always at its end)
SEND_EVERY_S = 0.5


class Progress(Protocol):
    """Where a run's progress goes: `Bars` (drawn here) or `SentBars` (sent to the process that draws them)."""

    def update(self, name: str, position: int, total: int, postfix: str | None = None) -> None: ...

    def finish(self, name: str) -> None: ...


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
