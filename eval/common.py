"""What the suites share: the command line and corpus a result records, threads and versions, the corpus's tokens,
the alternating-rounds helper every timed comparison uses, and the figure helpers.

A result never records an absolute path: its corpus is recorded by name, size and sha256 (`corpus_record`), and its
command line with the corpus as `<corpus>` and any other path relative to the current directory (`scrub_command`).
Importing this module is cheap (torch and h2o-stream are imported where they are used), so that the renderer, which
reads only JSON files, starts in a moment.
"""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import click

if TYPE_CHECKING:
    import torch

#: corpora the committed results were measured on, by sha256: what the name alone does not say
KNOWN_CORPORA = {
    "fc5ec85632126ad47472a49fec755bd68eb1a862fccda3b268b2c7923fff8792": (
        "21 public-domain Gutenberg books published before 1919"
    ),
}
CORPUS = "<corpus>"  # what a recorded command line shows in place of the corpus's path
RESULTS = Path("eval/results")

#: --data for every suite that reads text: the sample shipped with the package unless a corpus is named
data_option = click.option(
    "--data",
    default="sample",
    show_default=True,
    help="Corpus to read: sample (shipped with h2o-stream), or a .jsonl / .parquet / .txt file or a directory of them.",
)
#: --model for the timed suites (a local directory or .gguf loads offline; the tests pass a tiny random model)
model_option = click.option(
    "--model", "model_spec", default=None, help="Model to load (default: SmolLM2-135M-Instruct)."
)
#: --out-dir of `python -m eval speed` and its parts
speed_out_dir_option = click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=RESULTS / "speed",
    show_default=True,
    help="Where the JSON and PNG files go.",
)


class BadInput(click.ClickException):
    """A bad input to a suite: one clear `Error: ...` line and exit status 2 (click's own usage errors exit 2 too)."""

    exit_code = 2


retrieval_heads_option = click.option(
    "--retrieval-heads",
    default=None,
    help="head_hybrid's retrieval heads (needed to run it): a head classification file from h2o-stream calibrate, "
    "or LAYER.HEAD pairs.",
)


def suite_policy(name: str, cache_size: int | None, tokenizer=None, retrieval_heads: str | None = None):
    """`make_policy` for a suite's policy list: head_hybrid takes --retrieval-heads, and without it is one clear
    error (exit status 2) rather than a traceback."""
    from h2o_stream import make_policy

    if name != "head_hybrid":
        return make_policy(name, cache_size, tokenizer=tokenizer)
    if retrieval_heads is None:
        raise BadInput("head_hybrid needs --retrieval-heads (a head classification file from h2o-stream calibrate)")
    return make_policy(name, cache_size, tokenizer=tokenizer, retrieval_heads=retrieval_heads)


_invocation: list[str] = []


def invoked_with(argv: Sequence[str]) -> None:
    """Remember the arguments `python -m eval` was given, for the command line results record."""
    _invocation[:] = list(argv)


def command_line() -> str:
    """`python -m eval ...` as invoked, scrubbed by `scrub_command`."""
    return scrub_command(" ".join(["python -m eval", *(shlex.quote(word) for word in _invocation)]))


def scrub_command(command: str) -> str:
    """A command line as a result may record it: the corpus's path (the word after --data) as `<corpus>` unless it
    is the shipped sample, and any other absolute path relative to the current directory (a result says what ran,
    never where the files lay)."""
    words, out = shlex.split(command), []
    for i, word in enumerate(words):
        if word.startswith("--data="):
            word = "--data=" + _scrub_corpus(word.split("=", 1)[1])
        elif i > 0 and words[i - 1] == "--data":
            word = _scrub_corpus(word)
        out.append(relative(word))
    return " ".join(word if CORPUS in word else shlex.quote(word) for word in out)


def relative(path: str) -> str:
    """`path` relative to the current directory if it is absolute, else as it is."""
    return os.path.relpath(path) if os.path.isabs(path) else path


def _scrub_corpus(path: str) -> str:
    return path if path == "sample" else CORPUS


def corpus_record(data: str) -> dict:
    """The corpus `data` as a result records it: its name, what it is, its size in bytes and its sha256."""
    from h2o_stream.loading.corpus import corpus_digest, describe_source

    size, sha = corpus_digest(data)
    name = "sample" if data == "sample" else Path(data).name
    return {"name": name, "description": KNOWN_CORPORA.get(sha) or describe_source(data), "bytes": size, "sha256": sha}


def corpus_of(settings: dict) -> dict:
    """The corpus of a `h2o-stream ppl` result as the suites record one: name, what it is, bytes, sha256."""
    described, sha = settings.get("data", ""), settings.get("data_sha256")
    name = described.split(":")[0] if described.startswith("sample:") else described.rsplit(" (", 1)[0]
    return {
        "name": name,
        "description": KNOWN_CORPORA.get(sha) or described,
        "bytes": settings.get("data_bytes"),
        "sha256": sha,
    }


def load_model(spec: str | None, **options):
    """`h2o_stream.loading.models.load_model`, its name (recorded in results) relative if it is a local path."""
    import dataclasses

    from h2o_stream.loading import models

    loaded = models.load_model(spec, **options)
    return dataclasses.replace(loaded, name=relative(loaded.name))


def setup(threads: int) -> None:
    """Fix the torch thread count and seed before a measurement."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)


def environment() -> dict:
    """What a result depends on besides its settings: library versions, threads, machine, the command line."""
    import torch
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "machine": platform.machine(),
        "command": command_line(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }


def corpus_tokens(tokenizer, count: int, data: str) -> torch.Tensor:
    """The first `count` token ids of the corpus `data`, books one after another (each with its own BOS)."""
    import torch

    from h2o_stream.loading.corpus import book_token_ids, iter_books

    ids = []
    for book in iter_books(data):
        ids.extend(book_token_ids(book, tokenizer))
        if len(ids) >= count:
            break
    if len(ids) < count:
        raise BadInput(f"the corpus holds {len(ids):,} tokens, fewer than the {count:,} this run needs")
    return torch.tensor(ids[:count])


def alternate(steps: dict[str, Callable[[int, int], float]], rounds: int, per_round: int = 1) -> dict[str, list]:
    """Seconds of each contender per round, in alternating rounds: round r takes steps i = 0 .. per_round - 1, and at
    each step every contender's `step(r, i)` (which times its own work and returns the seconds) runs in turn, the
    order rotated by one at every step, so that the machine's noise and its slow drifts hit all contenders alike.
    Returns name -> [seconds of round 0, round 1, ...] (each the sum over the round's steps)."""
    names = list(steps)
    seconds = {name: [] for name in names}
    for r in range(rounds):
        total = dict.fromkeys(names, 0.0)
        for i in range(per_round):
            k = (r * per_round + i) % len(names)
            for name in names[k:] + names[:k]:
                total[name] += steps[name](r, i)
        for name in names:
            seconds[name].append(total[name])
    return seconds


def time_chunks(model, cache, stream: torch.Tensor, chunk: int, crop: bool) -> float:
    """Seconds over the chunks of `stream`; with `crop` (a raw DynamicCache) each chunk is dropped again, so that
    every chunk meets the same number of cached entries."""
    import torch

    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, stream.numel(), chunk):
            piece = stream[start : start + chunk]
            model(piece.unsqueeze(0), cache=cache)
            if crop:
                cache.crop(-piece.numel())
    return time.perf_counter() - started


def new_figure(*subplots: int, size: tuple[float, float]):
    """(figure, axes) from matplotlib's file-only backend: the suites draw PNGs, never windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*subplots, figsize=size)


def paired_bars(ax, groups: dict[str, dict[str, float]], pair: tuple[str, str], ylabel: str) -> None:
    """Two bars per group, side by side: `groups` maps each x label to {pair[0]: value, pair[1]: value}."""
    width = 0.38
    for offset, name, color in ((-width / 2, pair[0], "#4c72b0"), (width / 2, pair[1], "#dd8452")):
        ax.bar(
            [i + offset for i in range(len(groups))],
            [values[name] for values in groups.values()],
            width,
            label=name,
            color=color,
        )
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def save_figure(fig, path, title: str) -> None:
    """Title `fig`, write it to `path` atomically as a PNG, and free it."""
    import matplotlib.pyplot as plt

    from h2o_stream.files import atomic_path

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=110)
    plt.close(fig)


def run_commands(commands: list[list[str]], dry_run: bool) -> None:
    """Print each command as a shell line and, unless `dry_run`, run it (one at a time: never two torch processes at
    once), stopping at the first that fails, with its exit status."""
    for command in commands:
        click.echo(" ".join(shlex.quote(word) for word in command))
        if not dry_run:
            status = subprocess.run(command).returncode
            if status:
                raise SystemExit(status)


def write_result(
    path: str | os.PathLike, report: dict, plot: Callable[[dict, Path], None], figure: str | os.PathLike | None = None
) -> Path:
    """Write `report` as JSON at `path` and its figure (`plot(report, figure)`) at `figure`, by default beside it
    with the same name (.png); returns the JSON's path."""
    from h2o_stream.files import write_json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure = path.with_suffix(".png") if figure is None else Path(figure)
    write_json(path, report)
    plot(report, figure)
    print(f"wrote {path} and {figure}", file=sys.stderr)
    return path
