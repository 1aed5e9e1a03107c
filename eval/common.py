"""Shared bits for the benchmarks: threads, version stamp, the corpus option and its tokens, atomic result files."""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import click
import torch
import transformers

from h2o_stream.files import atomic_path, write_json  # noqa: F401  (write_json re-exported for the scripts)
from h2o_stream.loading.corpus import book_token_ids, iter_books

#: --data for every benchmark that reads text: the sample shipped with the package unless a corpus is named
data_option = click.option("--data", default="sample", show_default=True,
                           help="Corpus to read: sample (shipped with h2o-stream), or a .jsonl / .parquet / .txt file "
                                "or a directory of them.")


def setup(threads: int) -> None:
    """Fix the torch thread count and seed before a benchmark."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def environment() -> dict:
    """What a result depends on besides its settings: library versions, threads, machine, the command line."""
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "command": "python " + " ".join(sys.argv),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def corpus_tokens(tokenizer, count: int, data: str) -> torch.Tensor:
    """The first `count` token ids of the corpus `data`, books one after another (each with its own BOS)."""
    ids = []
    for book in iter_books(data):
        ids.extend(book_token_ids(book, tokenizer))
        if len(ids) >= count:
            break
    if len(ids) < count:
        raise click.ClickException(f"{data} holds {len(ids):,} tokens, fewer than the {count:,} this run needs")
    return torch.tensor(ids[:count])


@torch.no_grad()
def time_chunks(model, cache, stream: torch.Tensor, chunk: int, crop: bool) -> float:
    """Seconds per token over the chunks of `stream`; with `crop` (a raw DynamicCache) each chunk is dropped again, so
    that every chunk meets the same number of cached entries."""
    started = time.perf_counter()
    for start in range(0, stream.numel(), chunk):
        piece = stream[start:start + chunk]
        model(piece.unsqueeze(0), cache=cache)
        if crop:
            cache.crop(-piece.numel())
    return (time.perf_counter() - started) / stream.numel()


def race(model, contenders: dict, prefix: torch.Tensor, timed: torch.Tensor, rounds: int, tokens: int,
         context=lambda name: contextlib.nullcontext()) -> dict[str, list[float]]:
    """Seconds per token of each contender over `rounds` rounds that alternate between them, each cache first
    filled with `prefix`. `contenders` maps a name to (make a cache, tokens per forward, crop back (a raw
    DynamicCache), tokens per round); round r reads `timed` from r * tokens on, under `context(name)`."""
    caches = {}
    with torch.no_grad():
        for name, (make, *_rest) in contenders.items():
            caches[name] = make()
            model(prefix.unsqueeze(0), cache=caches[name])
    seconds = {name: [] for name in contenders}
    for r in range(rounds):
        for name, (_, width, crop, count_tokens) in contenders.items():
            block = timed[r * tokens:r * tokens + count_tokens]
            with context(name):
                seconds[name].append(time_chunks(model, caches[name], block, width, crop=crop))
    return seconds


def new_figure(*subplots: int, size: tuple[float, float]):
    """(figure, axes) from matplotlib's file-only backend: the benchmarks draw PNGs, never windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*subplots, figsize=size)


def paired_bars(ax, groups: dict[str, dict[str, float]], pair: tuple[str, str], ylabel: str) -> None:
    """Two bars per group, side by side: `groups` maps each x label to {pair[0]: value, pair[1]: value}."""
    width = 0.38
    for offset, name, color in ((-width / 2, pair[0], "#4c72b0"), (width / 2, pair[1], "#dd8452")):
        ax.bar([i + offset for i in range(len(groups))], [values[name] for values in groups.values()], width,
               label=name, color=color)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)


def save_pairs_by_threads(by_threads: dict[str, dict[str, float]], pair: tuple[str, str], ylabel: str, path,
                          title: str, reference: float | None = None) -> None:
    """A PNG of `paired_bars`, one group per thread count (`by_threads` maps "1", "2", ... to the pair's values),
    with a dashed line at `reference` if given."""
    fig, ax = new_figure(size=(6, 3.4))
    paired_bars(ax, {f"{threads} thread(s)": values for threads, values in by_threads.items()}, pair, ylabel)
    if reference is not None:
        ax.axhline(reference, color="red", linestyle="--")
    save_figure(fig, path, title)


def save_figure(fig, path, title: str) -> None:
    """Title `fig`, write it to `path` atomically as a PNG, and free it."""
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    with atomic_path(path) as partial:
        fig.savefig(partial, dpi=110)
    plt.close(fig)


def main_or_replot(main, plot) -> None:
    """`script.py --plot-only RESULT.json` redraws the PNG next to a result JSON; anything else runs the benchmark."""
    import json

    if len(sys.argv) == 3 and sys.argv[1] == "--plot-only":
        plot(json.loads(open(sys.argv[2]).read()), sys.argv[2].replace(".json", ".png"))
    else:
        main()


def export(revision: str, into: Path) -> Path:
    """The repository's tree at `revision`, extracted under `into` (to run an earlier commit beside this one)."""
    target = into / revision.replace("/", "_").replace("^", "_parent")
    target.mkdir()
    archive = subprocess.run(["git", "archive", revision], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive, check=True)
    return target


def short_revision(revision: str) -> str:
    """`git rev-parse --short` of `revision` (what a result records of the commits it compares)."""
    return subprocess.run(["git", "rev-parse", "--short", revision], capture_output=True, text=True,
                          check=True).stdout.strip()
