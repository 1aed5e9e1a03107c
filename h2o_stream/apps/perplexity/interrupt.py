"""Stopping a sweep cleanly on SIGINT (Ctrl-C) or SIGTERM: finish the chunk, write a checkpoint, say how to resume.

While `StopRequest.catching()` is active, the first signal only sets a flag; the sweep checks it after every chunk,
checkpoints there (a chunk boundary of the uninterrupted run, so the resumed run is bit-identical) and raises
`Interrupted`. A second signal stops at once with KeyboardInterrupt; the last checkpoint is intact either way, since
checkpoints are written atomically.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """A stop asked for by a signal: `signum` is the first one received, None until then."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @contextlib.contextmanager
    def catching(self) -> Iterator[StopRequest]:
        """Turn SIGINT/SIGTERM into a stop request for the duration (signals can only be caught in the main
        thread; elsewhere this does nothing). The previous handlers come back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return

        def handle(signum, frame):
            if self.signum is not None:
                raise KeyboardInterrupt  # asked twice: stop now
            self.signum = signum

        previous = {s: signal.signal(s, handle) for s in SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


class Interrupted(Exception):
    """A sweep stopped on request: `run` is the run it stopped in (None: between runs), `position` the token its
    checkpoint is at. `exit_status` is the shell's convention for death by that signal (130 for SIGINT)."""

    def __init__(self, signum: int, run: str | None, position: int | None):
        self.signum, self.run, self.position = signum, run, position
        where = (
            f"{run} checkpointed at token {position:,}"
            if run is not None and position is not None
            else "stopped between runs"
        )
        super().__init__(f"interrupted by {signal.Signals(signum).name}: {where}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum
