"""Executing a sweep's runs: feeding them to --tokens with paced checkpoints, and the result file each one leaves.

`execute` feeds one run, or several as the rows of one batch, checkpointing every --checkpoint-every tokens, before a
last forward that --tokens cuts short and at the end, so that a resumed or extended run equals an uninterrupted one;
a requested stop checkpoints after the current forward. `write` turns a failed write into one clear error.

A result file (`<run>.json`, `result_record`) is `PerplexityResult.to_json()` plus `requested_tokens`,
`corpus_exhausted` (the corpus ended first), `stream_sha256` (digest of the tokens fed), `data_path` (the corpus's path
relative to where the command ran; its size and sha256 are in `settings`), `versions` (h2o_stream, torch,
transformers, python, threads) and `command` (absolute paths in it made relative). Its `rss_samples` are (stream
position, resident bytes) at doublings of the position and of the tokens the current process fed, and at the end;
`process_starts` says where each of the run's processes began (a resumed run's memory is comparable within one).
"""

from __future__ import annotations

import datetime
import errno
import platform
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from h2o_stream.errors import H2OStreamError
from h2o_stream.version import __version__

from .binding import portable_command
from .interrupt import Interrupted, StopRequest
from .progress import Bars, Progress
from .rows import RunRows
from .run import PerplexityRun


def execute(
    runs: list[PerplexityRun],
    pieces,
    tokens: int,
    checkpoint_paths: list[Path],
    checkpoint_every: int,
    stop: StopRequest | None = None,
    name: str | None = None,
    bars: Progress | None = None,
) -> None:
    """Feed `runs` (one, or several at the same stream position fed as the rows of one batch: `RunRows`) up to
    `tokens` stream tokens with a progress bar, checkpointing every `checkpoint_every` tokens and at the end, so that
    a resumed or extended run equals an uninterrupted one. A requested `stop` checkpoints after the current forward
    and raises `Interrupted`. Progress goes to `bars` (default: a bar drawn here), named `name` (default: the run's)."""
    feeder = runs[0] if len(runs) == 1 else RunRows(runs)
    last_checkpoint = feeder.position
    bars = Bars() if bars is None else bars
    label = name or checkpoint_paths[0].stem
    bars.update(label, feeder.position, tokens)

    def progress(_, fed: int) -> None:
        ppl = "ppl=" + "/".join(f"{run.running_ppl:.2f}" for run in runs) if runs[0].predicted else None
        bars.update(label, feeder.position, tokens, ppl)

    def save(_=None) -> None:
        nonlocal last_checkpoint
        for run, path in zip(runs, checkpoint_paths, strict=True):
            try:
                run.save(path)
            except OSError as error:
                full = " (the disk is full)" if error.errno in (errno.ENOSPC, errno.EDQUOT) else ""
                kept = (
                    f"the last good checkpoint, at token {last_checkpoint:,}, is kept"
                    if path.exists()
                    else "there is no earlier checkpoint of this run"
                )
                raise H2OStreamError(
                    f"could not write the checkpoint {path}: {error.strerror or error}{full}; no "
                    f"partial file is left and {kept}. Free some space and continue with --resume"
                ) from None
        last_checkpoint = feeder.position

    def checkpoint(_) -> None:
        if stop is not None and stop.signum is not None:  # a stop was requested
            save()
            raise Interrupted(stop.signum, name or checkpoint_paths[0].stem, feeder.position)
        if feeder.position - last_checkpoint >= checkpoint_every:
            save()

    cut_short = False

    def save_before_cut(_) -> None:
        # The last forward is cut short by --tokens: checkpoint before it, so that a later --resume with more
        # --tokens feeds it whole and equals an uninterrupted run.
        nonlocal cut_short
        save()
        cut_short = True

    try:
        feeder.run(pieces, limit=tokens, on_progress=progress, checkpoint=checkpoint, before_cut_short=save_before_cut)
    finally:
        bars.finish(label)
    if not cut_short and feeder.position != last_checkpoint:
        save()


def write(path: Path, writer: Callable[[Path], None]) -> None:
    """`writer(path)`, a failed write (a full disk) as one clear error; the previous file stays intact."""
    try:
        writer(path)
    except OSError as error:
        raise H2OStreamError(f"could not write {path}: {error.strerror or error}; the previous file is kept") from None


def result_record(run: PerplexityRun, requested_tokens: int, command: str, corpus_path: str | None = None) -> dict:
    """The result file's content for `run` (see the module docstring for the schema); the command and the corpus's
    path are recorded relative to the current directory."""
    result = run.result().to_json()
    result["requested_tokens"] = requested_tokens
    result["corpus_exhausted"] = run.position < requested_tokens
    result["stream_sha256"] = run.digest.hexdigest()
    result["data_path"] = corpus_path
    result["versions"] = versions()
    result["command"] = portable_command(command)
    result["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return result


def versions() -> dict:
    """The versions a result was made with, and torch's thread count (it changes speed, not results)."""
    return {
        "h2o_stream": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
    }
