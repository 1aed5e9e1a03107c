"""`h2o-stream leaderboard`: every policy × cache size on one stream, resumable anywhere, as a table and two plots."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import click

from h2o_stream.apps.perplexity.interrupt import Interrupted
from h2o_stream.apps.perplexity.leaderboard import FILES, markdown, write_leaderboard
from h2o_stream.engine.policies import POLICIES
from h2o_stream.errors import H2OStreamError

from .options import (
    books_options,
    cache_options,
    checkpoint_option,
    command_argv,
    data_option,
    given_options,
    loading_note,
    model_options,
    ray_option,
    rows_option,
    sliding_option,
    stream_tokens_at_least,
    workers_option,
)

#: every registered policy with a bounded cache (full has no cache size to compare at) that runs at its defaults
#: (head_hybrid needs its head classification: it runs when named, with --retrieval-heads)
BOUNDED = ",".join(name for name, cls in POLICIES.items() if cls.parts and not cls.required_options)


@click.command()
@model_options
@cache_options(BOUNDED, "128,256,512", multiple=True)
@click.option(
    "--tokens",
    type=int,
    default=250_000,
    show_default=True,
    callback=stream_tokens_at_least,
    help="Stream tokens per run.",
)
@data_option
@books_options
@click.option(
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    default="h2o-stream-leaderboard",
    show_default=True,
    help="Directory for the leaderboard; the runs go to its runs/ folder.",
)
@checkpoint_option
@workers_option
@rows_option
@ray_option
@sliding_option
@click.option("--report-only", is_flag=True, help="Redraw the table and plots from the finished runs; run nothing.")
def leaderboard(
    model_spec,
    dtype,
    device,
    threads,
    policy,
    cache_size,
    parts,
    no_rolling,
    tokens,
    data,
    books,
    book_tokens,
    out_dir,
    checkpoint_every,
    workers,
    rows,
    ray_address,
    sliding,
    report_only,
):
    """Rank eviction policies: perplexity of every --policy at every --cache-size over the same stream.

    Runs go one cache size at a time (all policies at the first size, then the next), each with its policy's default
    (fair) chunk size, into OUT/runs as `h2o-stream ppl` runs. Running the same command again continues: finished
    runs are kept (their result files are enough, so a fresh clone holding them continues on another machine), an
    interrupted one resumes from its checkpoint when this machine has it. OUT gets leaderboard.md (a heading with the
    model, the corpus and its sha256, the tokens and the date; then PPL, ratio to sink and to h2o at each size, keys
    seen, tok/s, predicted tokens), leaderboard.json, ppl_vs_cache.png and windowed_ppl.png.
    """
    out = Path(out_dir)
    runs = out / "runs"
    if report_only:
        ignored = list(given_options(exclude=("out_dir", "report_only")).values())
        if ignored:
            raise H2OStreamError(
                f"--report-only redraws the leaderboard from the runs in {runs} and runs nothing: "
                f"{', '.join(ignored)} would be ignored; drop {'it' if len(ignored) == 1 else 'them'}"
            )
        if not runs.is_dir() or not any(runs.glob("*.json")):
            raise H2OStreamError(f"{runs} holds no finished runs to report on")
    else:
        loading_note(model_spec)
        from h2o_stream.apps.perplexity.launch import run_sweep  # imported here: --help loads no torch
        from h2o_stream.apps.perplexity.sweep import Sweep, run_specs

        argv = command_argv()

        def specs(tokenizer=None):  # all policies at the first size, then the next
            return [spec for size in cache_size for spec in run_specs(policy, [size], parts, tokenizer=tokenizer)]

        sweep = Sweep(
            specs(),
            runs,
            data,
            tokens,
            rolling=not no_rolling,
            books=books,
            book_tokens=book_tokens,
            checkpoint_every=checkpoint_every,
            resume=True,
            command=shlex.join(argv),
            rows=rows,
            sliding=sliding,
        )
        try:
            run_sweep(
                sweep,
                specs,
                argv,
                lambda text: click.echo(text, err=True),
                workers=workers,
                ray_address=ray_address,
                resumes_as_given=True,
                spec=model_spec,
                dtype=dtype,
                device=device,
                threads=threads,
            )
        except Interrupted as stopped:  # checkpointed, and the command that resumes told
            sys.exit(stopped.exit_status)
    board = write_leaderboard(runs, out)
    click.echo(markdown(board), nl=False)
    click.echo(f"leaderboard: {out}/ ({', '.join(FILES)}); runs in {runs}/", err=True)
