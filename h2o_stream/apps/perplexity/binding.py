"""What binds a run to its model, data and settings, checked for every run of a sweep before the first one starts.

- The settings a run compares on --resume (and records in its result) include the model's name and a fingerprint of
  its weights, dtype, device, the corpus (its description, size and sha256), --skip-tokens and
  --curve-every, besides the policy, chunk size, rolling and reset-per-book that `PerplexityRun` adds.
- A checkpoint carries a digest of the tokens it fed (`StreamDigest`); `check_stream` reads the corpus once, up to
  the furthest checkpoint, and refuses a corpus whose first tokens differ (another corpus under the same name, a file
  edited in place, another tokenizer). It also refuses a stream with nothing to predict.
- `plan` refuses a resume that would replace a finished or further-along run with a shorter one.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.corpus import corpus_digest

from .digest import StreamDigest
from .run import PerplexityRun, settings_difference
from .schema import read_result


def model_fingerprint(model) -> str:
    """A short digest of the model's parameters (names, shapes and their first values, rounded to bfloat16 so that
    only the dtype option tells dtypes apart): what a checkpoint's cache depends on beyond the model's name."""
    sha = hashlib.sha256()
    for name, parameter in model.named_parameters():
        sha.update(f"{name}{tuple(parameter.shape)}".encode())
        head = parameter.detach().reshape(-1)[:64].to("cpu", torch.bfloat16).contiguous()
        sha.update(head.view(torch.int16).numpy().tobytes())
    return sha.hexdigest()[:16]


def corpus_settings(source: str | os.PathLike | None) -> dict:
    """What binds a run to its corpus: the corpus's size and sha256 (see `corpus_digest`), not where it lies, so that
    the same text at another path (another machine, a fresh clone) continues a run, and another text never does."""
    digest = corpus_digest(source)
    return {"data_bytes": digest and digest[0], "data_sha256": digest and digest[1]}


def data_path(source: str | os.PathLike | None) -> str | None:
    """Where a corpus was read from, as a result records it: 'sample' or None (the Hub) as given, else the path
    relative to the current directory (an absolute path means nothing on another machine)."""
    if source is None or os.fspath(source) == "sample":
        return None if source is None else "sample"
    return os.path.relpath(Path(source).expanduser().resolve())


def portable_command(command: str) -> str:
    """`command` with every absolute path in it (an argument, or an option's `=value`) made relative to the current
    directory, for result files that are read on other machines."""

    def relative(argument: str) -> str:
        option, equals, value = argument.rpartition("=") if argument.startswith("-") else ("", "", argument)
        return option + equals + (os.path.relpath(value) if os.path.isabs(value) else value)

    return shlex.join(relative(argument) for argument in shlex.split(command))


@dataclass
class Plan:
    """What a run of the sweep starts from: its checkpoint position (0: from the start) and that checkpoint's digest
    of the tokens it fed; `done` when its result file already covers the tokens asked for (it fed that many, or the
    corpus ran out first), so that it needs no checkpoint to be resumed, e.g. on another machine. `result_tokens`:
    the tokens its result file covers (0: none)."""

    name: str
    position: int = 0
    stream_digest: str | None = None
    done: bool = False
    result_tokens: int = 0


def plan(name: str, run: PerplexityRun, out: Path, tokens: int, resume: bool) -> Plan:
    """Check the files of run `name` in `out` against `run` and `tokens`: a checkpoint must be intact and made with
    the same settings, a result file must have the same settings, and neither may be further along than `tokens`
    (a shorter run never replaces a longer one). Nothing is changed."""
    found, have, where = Plan(name), 0, None
    checkpoint = out / f"{name}.ckpt"
    if resume and checkpoint.exists():
        state = run.read(checkpoint)
        found = Plan(name, int(state["position"]), StreamDigest(state["stream"]).hexdigest())
        have, where = found.position, "a checkpoint at"
    result_path = out / f"{name}.json"
    if result_path.exists():
        previous = read_result(result_path)
        settings, fed = previous["settings"], previous["tokens_fed"]
        exhausted = previous.get("corpus_exhausted") is True
        if settings != run.settings:
            raise H2OStreamError(
                f"{result_path} holds a result made with other settings "
                f"({settings_difference(settings, run.settings)}); rerun with the same settings or "
                "choose another --out"
            )
        if fed > have:
            have, where = fed, "a result of"
        found.done = fed >= tokens or exhausted
        found.result_tokens = fed
    if tokens < have:
        raise H2OStreamError(
            f"{out} already holds {where} {have:,} tokens for {name}; --tokens {tokens:,} would "
            f"replace it with a shorter run. Pass --tokens {have} or more to keep or extend it, or "
            "choose another --out"
        )
    return found


def check_stream(
    pieces: Iterable[tuple[int, torch.Tensor]],
    plans: list[Plan],
    *,
    tokens: int,
    reset_per_book: bool,
    source: str,
    skip_tokens: int,
    count_to: int = 0,
) -> int:
    """Read the stream (pieces after --skip-tokens) as far as the furthest checkpoint, until a first prediction and
    for at least `count_to` tokens: every checkpoint must match the stream's digest at its position, and the first
    `tokens` tokens must hold at least one prediction. H2OStreamError otherwise, before any run has started.
    Returns the stream tokens read, at most `tokens` (all of them when the stream is shorter than `count_to`)."""
    wanted = sorted({p.position for p in plans if p.position})
    seen: dict[int, str] = {}
    digest = StreamDigest()
    fed = predictions = 0
    book = None
    for index, ids in pieces:
        n = ids.numel()
        within = max(0, min(n, tokens - fed))
        if within:
            starts_anew = book is None or (reset_per_book and index != book)  # its first token is not predicted
            predictions += within - 1 if starts_anew else within
            book = index
        offset = 0
        while wanted and wanted[0] <= fed + n:
            target = wanted.pop(0)
            digest.update(index, ids[offset : target - fed])
            offset = target - fed
            seen[target] = digest.hexdigest()
        if wanted:
            digest.update(index, ids[offset:])
        fed += n
        if not wanted and predictions and fed >= count_to:
            break
    if not predictions:
        after = f" after --skip-tokens {skip_tokens:,}" if skip_tokens else ""
        first = "each book's first token" if reset_per_book else "the first token"
        raise H2OStreamError(
            f"nothing to predict: {source} has {fed:,} token(s){after} within --tokens {tokens:,}, "
            f"and {first} is never predicted; a perplexity needs at least two tokens in a row"
        )
    for found in plans:
        if found.position and seen.get(found.position) != found.stream_digest:
            short = f" (it now has only {fed:,} tokens)" if found.position not in seen else ""
            raise H2OStreamError(
                f"{source} is not the corpus {found.name}'s checkpoint was made from: the {found.position:,} tokens it "
                f"fed differ from the corpus now{short}. Another corpus under the same name, a corpus edited since or "
                "another tokenizer would mix two streams in one result; resume with the original corpus, or choose "
                "another --out"
            )
    return min(fed, tokens)
