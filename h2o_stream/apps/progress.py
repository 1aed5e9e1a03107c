"""Progress of long jobs (a perplexity run, the leaderboard's runs, a calibration, a summary's reading): one bar per
job in progress on a terminal, plain lines where stderr is not one.

On a terminal each job has a bar on a line of its own, named by the job (a run: policy-cache size), with notes
printed above them; TQDM_DISABLE=1 turns the bars off. Elsewhere (a log file, a pipe, nohup, CI) a bar would show
nothing, so every PROGRESS_EVERY_S seconds (H2O_STREAM_PROGRESS_EVERY, in seconds; "off" for none) each job in
progress gets a line:

    h2o-64: 1536/4096 tokens (37%), 812.4 tok/s, ppl=12.34, 0:00:03 left

tokens done / total, the rate since this process began the job, what the job adds (a run's running perplexity) and
the time left at that rate; a job that printed lines prints one more at its end.
"""

from __future__ import annotations

import datetime
import math
import os
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from h2o_stream.errors import H2OStreamError

#: seconds between two progress lines of a job when stderr is not a terminal
PROGRESS_EVERY_S = 60.0
#: the environment variable that overrides PROGRESS_EVERY_S (seconds, or "off")
PROGRESS_EVERY_VARIABLE = "H2O_STREAM_PROGRESS_EVERY"


def progress_every() -> float | None:
    """Seconds between progress lines: H2O_STREAM_PROGRESS_EVERY (a positive number; "off": None, no lines), else
    PROGRESS_EVERY_S. Anything else is one clear H2OStreamError."""
    value = os.environ.get(PROGRESS_EVERY_VARIABLE, "").strip()
    if not value:
        return PROGRESS_EVERY_S
    if value.lower() == "off":
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        raise H2OStreamError(
            f"{PROGRESS_EVERY_VARIABLE} must be a positive number of seconds between progress lines, or 'off'; "
            f"got {value!r}"
        )
    return seconds


@dataclass
class _Job:
    """What a job's progress lines need: where and when this process first saw it, and its last line."""

    start_position: int
    start_time: float
    line_time: float
    line_position: int | None = None
    position: int = 0
    total: int = 0
    postfix: str | None = field(default=None)


def progress_line(name: str, position: int, total: int, rate: float | None, postfix: str | None) -> str:
    """`name`'s progress line (see the module docstring); `rate` in tokens per second (None: not known yet)."""
    done = min(position, total)
    parts = [f"{name}: {done}/{total} tokens ({100 * done // max(total, 1)}%)"]
    parts.append("? tok/s" if rate is None else f"{rate:.1f} tok/s")
    if postfix:
        parts.append(postfix)
    if rate:
        parts.append(f"{datetime.timedelta(seconds=round((total - done) / rate))} left")
    else:
        parts.append("? left")
    return ", ".join(parts)


class Bars:
    """The progress of the jobs in progress in this process, by name: bars on a terminal, else lines (see the module
    docstring). `leave`: a finished job's bar stays on the screen (one process running one job after another); off
    when several draw at once, whose lines move up as others finish. `every`: seconds between lines (default:
    `progress_every()`)."""

    def __init__(self, *, leave: bool = True, file=None, every: float | None = None):
        self.leave, self.file = leave, file
        self.bars: dict[str, tqdm] = {}
        stream = file or sys.stderr
        isatty = getattr(stream, "isatty", None)
        self.lines = not (isatty is not None and isatty())
        self.every = (every if every is not None else progress_every()) if self.lines else None
        self.jobs: dict[str, _Job] = {}

    def update(self, name: str, position: int, total: int, postfix: str | None = None) -> None:
        """Job `name` is at token `position` of `total`; `postfix` (e.g. its running perplexity) follows."""
        if self.lines:
            self._line(name, position, total, postfix)
            return
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

    def _line(self, name: str, position: int, total: int, postfix: str | None) -> None:
        if self.every is None:
            return
        now = time.monotonic()
        job = self.jobs.get(name)
        if job is None:
            job = self.jobs[name] = _Job(start_position=position, start_time=now, line_time=now)
        job.position, job.total, job.postfix = position, total, postfix or job.postfix
        if now - job.line_time >= self.every:
            self._print(name, job, now)

    def _print(self, name: str, job: _Job, now: float) -> None:
        elapsed = now - job.start_time
        rate = (job.position - job.start_position) / elapsed if elapsed > 0 else None
        print(progress_line(name, job.position, job.total, rate, job.postfix), file=self.file or sys.stderr, flush=True)
        job.line_time, job.line_position = now, job.position

    def finish(self, name: str) -> None:
        job = self.jobs.pop(name, None)
        if job is not None and job.line_position is not None and job.line_position != job.position:
            self._print(name, job, time.monotonic())  # where a job that showed its progress ended
        bar = self.bars.pop(name, None)
        if bar is not None:
            bar.close()

    def note(self, write, text: str) -> None:
        """`write(text)` (a line to the same terminal) with the bars cleared first and redrawn below it."""
        with tqdm.external_write_mode(file=self.file or sys.stderr):
            write(text)

    def close(self) -> None:
        for name in [*self.bars, *self.jobs]:
            self.finish(name)
