"""`h2o-stream ppl`: streaming perplexity for several policies × cache sizes, resumable, with plot and table."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from h2o_stream.apps.perplexity.interrupt import Interrupted
from h2o_stream.apps.perplexity.report import summary_table
from h2o_stream.errors import H2OStreamError

from .options import (
    at_least,
    books_options,
    cache_options,
    checkpoint_option,
    command_argv,
    data_option,
    loading_note,
    model_options,
    ray_option,
    rows_option,
    sliding_option,
    stream_tokens_at_least,
    workers_option,
)


@click.command()
@model_options
@cache_options("h2o,sink", 256, multiple=True)
@click.option(
    "--chunk-size",
    type=int,
    default=None,
    callback=at_least(1),
    help="Tokens per forward pass (fast mode). Default: 256 for sink, window and full (their chunks equal "
    "exact mode), a sixteenth of the cache size for the other policies, but at most the largest power "
    "of two up to their recent window + 1 (a chunk shields its own tokens from cuts: tova 1); roco "
    "runs exact mode (1), compiled.",
)
@click.option(
    "--exact", is_flag=True, help="Token-by-token reference mode (chunk size 1: the cache decides after every token)."
)
@click.option(
    "--span",
    type=int,
    default=None,
    callback=at_least(1),
    help="Tokens per model forward, a multiple of the chunk size; the cache still decides every chunk, "
    "inside each layer, so results are the same as one forward per chunk (speed only). Default: the "
    "largest multiple of the chunk size up to 256.",
)
@click.option(
    "--wide-chunks",
    is_flag=True,
    help="Let a chunk's queries see all cached entries plus their chunk predecessors (up to cache size + "
    "chunk size keys). By default no query sees more than cache size + 1 keys, as in exact mode.",
)
@click.option(
    "--tokens",
    type=int,
    default=100_000,
    show_default=True,
    callback=stream_tokens_at_least,
    help="Stream tokens to evaluate per run.",
)
@data_option
@books_options
@click.option("--skip-tokens", type=click.IntRange(min=0), default=0, help="Start this far into the stream.")
@click.option("--reset-per-book", is_flag=True, help="Empty the cache at each book instead of carrying it over.")
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="h2o-stream-ppl",
    show_default=True,
    help="Directory for results JSON, checkpoints and the plot.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Continue the runs checkpointed in --out (settings must match); finished runs can be extended "
    "with a larger --tokens and give the same result as one uninterrupted run.",
)
@checkpoint_option
@click.option(
    "--curve-every",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Tokens between points of the running-PPL curve.",
)
@workers_option
@rows_option
@ray_option
@sliding_option
def ppl(
    model_spec,
    dtype,
    device,
    threads,
    policy,
    cache_size,
    parts,
    no_rolling,
    chunk_size,
    exact,
    span,
    wide_chunks,
    tokens,
    data,
    books,
    book_tokens,
    skip_tokens,
    reset_per_book,
    out_dir,
    resume,
    checkpoint_every,
    curve_every,
    workers,
    rows,
    ray_address,
    sliding,
):
    """Perplexity over a long token stream with a fixed-size cache, e.g. H2O against StreamingLLM sinks.

    Every policy × cache size is one run; the budget split of each is printed. Results go to --out: one JSON per
    run, a checkpoint per run (for --resume), ppl.png and summary.json (over every run in --out). One run at a time
    may use an --out directory. Ctrl-C (or SIGTERM) finishes the current chunk, writes a checkpoint and prints the
    command that resumes.
    """
    if exact:
        if chunk_size not in (None, 1):
            raise H2OStreamError("--exact runs token by token; drop --chunk-size or --exact")
        chunk_size = 1
    if span is not None and chunk_size is not None and span % chunk_size:
        raise H2OStreamError(f"--span must be a positive multiple of the chunk size ({chunk_size}), got {span}")
    loading_note(model_spec)
    from h2o_stream.apps.perplexity.launch import run_sweep  # imported here: --help loads no torch
    from h2o_stream.apps.perplexity.sweep import Sweep, run_specs

    argv = command_argv()
    # every run that needs no tokenizer is built (and so checked) before the model loads; the rest once it has
    sweep = Sweep(
        run_specs(policy, cache_size, parts),
        Path(out_dir),
        data,
        tokens,
        chunk_size=chunk_size,
        span=span,
        rolling=not no_rolling,
        wide_chunks=wide_chunks,
        reset_per_book=reset_per_book,
        skip_tokens=skip_tokens,
        books=books,
        book_tokens=book_tokens,
        checkpoint_every=checkpoint_every,
        curve_every=curve_every,
        resume=resume,
        command=shlex.join(argv),
        rows=rows,
        sliding=sliding,
    )
    try:
        results = run_sweep(
            sweep,
            lambda tokenizer: run_specs(policy, cache_size, parts, tokenizer=tokenizer),
            argv,
            lambda text: click.echo(text, err=True),
            workers=workers,
            ray_address=ray_address,
            spec=model_spec,
            dtype=dtype,
            device=device,
            threads=threads,
        )
    except Interrupted as stopped:  # checkpointed, and the command that resumes told
        sys.exit(stopped.exit_status)
    click.echo(summary_table(results))
    click.echo(f"results: {sweep.out}/ (ppl.png, summary.json, one JSON per run)", err=True)
