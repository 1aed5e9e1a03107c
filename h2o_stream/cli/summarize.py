"""`h2o-stream summarize FILE`: summarize a document of any length with a fixed-size KV cache."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from .options import cache_options, model_options
from h2o_stream.errors import H2OStreamError
from h2o_stream.apps.summarize.summarize import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_INSTRUCTION,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_POLICY,
    DEFAULT_SECTION_MAX_NEW_TOKENS,
    STRATEGIES,
    Document,
    as_document,
    check_settings,
    summarize as summarize_document,
)


@click.command("summarize")
@click.argument("file", metavar="FILE")
@click.option("--book", default=None, metavar="INDEX_OR_TITLE",
              help="For a PG-19 .jsonl file: the row to summarize, by index or (part of its) title.")
@click.option("--strategy", type=click.Choice(STRATEGIES), default="single", show_default=True,
              help="single: stream the whole document into the cache, then summarize. hierarchical: summarize "
                   "sections, then the summaries.")
@click.option("--instruction", default=DEFAULT_INSTRUCTION, show_default=True, help="What to ask for.")
@click.option("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, show_default=True)
@click.option("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE, show_default=True,
              help="Tokens per forward pass while reading (1 = exact, token by token).")
@click.option("--section-tokens", type=int, default=None,
              help="hierarchical: tokens per section (default: the cache size).")
@click.option("--section-max-new-tokens", type=int, default=DEFAULT_SECTION_MAX_NEW_TOKENS, show_default=True,
              help="hierarchical: length limit of each section summary.")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy (deterministic).")
@click.option("--seed", type=int, default=None, help="Seed for sampling (with --temperature > 0).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True, help="1 = off.")
@click.option("--out", "out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the summary to this file (e.g. summary.md).")
@click.option("--show-sections", is_flag=True, help="hierarchical: print each section summary as it is made.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or statistics on stderr.")
@cache_options(DEFAULT_POLICY, DEFAULT_CACHE_SIZE)
@model_options
def summarize(file, book, strategy, instruction, max_new_tokens, chunk_size, section_tokens, section_max_new_tokens,
              temperature, seed, repetition_penalty, out, show_sections, quiet, policy, cache_size, heavy, recent,
              sinks, no_rolling, model_spec, dtype, device, threads):
    """Summarize FILE (text, .md, or a PG-19 .jsonl with --book; '-' reads stdin), however long, reading it through a
    fixed-size KV cache. The summary streams to stdout; progress and statistics go to stderr."""
    try:
        size = int(cache_size)
    except ValueError:
        raise H2OStreamError(f"--cache-size must be a whole number, got {cache_size!r}") from None
    check_settings(strategy=strategy, instruction=instruction, max_new_tokens=max_new_tokens, policy=policy,
                   cache_size=size, heavy=heavy, recent=recent, sinks=sinks, chunk_size=chunk_size,
                   section_tokens=section_tokens, section_max_new_tokens=section_max_new_tokens)
    if out is not None and not out.parent.expanduser().is_dir():
        raise H2OStreamError(f"cannot write {out}: directory {out.parent} does not exist")
    if file == "-":
        if book is not None:
            raise H2OStreamError("--book needs a .jsonl file, not stdin")
        document = Document(text=sys.stdin.read(), title="stdin")
        document = as_document(document)
    else:
        document = as_document(Path(file), book=book)  # bad files fail here, before the model loads

    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="tok", unit_scale=True, desc="reading", file=sys.stderr, leave=False,
                       dynamic_ncols=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    def section(part) -> None:
        if show_sections:
            click.echo(f"[level {part.level} part {part.index + 1}, tokens {part.start}-{part.end}] {part.text}\n",
                       err=True)

    def text(piece: str) -> None:
        click.echo(piece, nl=False)
        sys.stdout.flush()

    if not quiet:
        click.echo(f"summarizing {document.title or 'the document'} ({strategy}, {policy} cache {size})", err=True)
    result = summarize_document(
        document, model_spec, policy=policy, cache_size=size, heavy=heavy, recent=recent, sinks=sinks,
        chunk_size=chunk_size, max_new_tokens=max_new_tokens, instruction=instruction, strategy=strategy,
        section_tokens=section_tokens, section_max_new_tokens=section_max_new_tokens, rolling=not no_rolling,
        temperature=temperature, seed=seed, repetition_penalty=repetition_penalty, dtype=dtype, device=device,
        threads=threads, on_progress=None if quiet else progress, on_text=text,
        on_section=section if strategy == "hierarchical" else None)
    if bar is not None:
        bar.close()
    click.echo()
    if out is not None:
        try:
            out.expanduser().write_text(result.text + "\n", encoding="utf-8")
        except OSError as error:
            raise H2OStreamError(f"cannot write {out}: {error.strerror or error}") from None
    if not quiet:
        policy_text = " ".join(f"{k}={v}" for k, v in result.policy.items() if k != "policy")
        sections = f", {len(result.sections)} section summaries" if result.sections else ""
        click.echo(
            f"read {result.tokens_read:,} document tokens ({result.tokens_fed:,} fed in all, "
            f"{result.tokens_per_second:.0f} tok/s) with {result.policy['policy']} {policy_text}"
            f"{sections}; {result.evictions:,} cache entries evicted; peak {result.peak_slots} per layer & KV head; "
            f"{result.tokens_generated} tokens generated; {result.seconds:.1f} s"
            + (f"; wrote {out}" if out is not None else ""), err=True)
