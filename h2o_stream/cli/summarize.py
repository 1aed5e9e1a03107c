"""`h2o-stream summarize FILE`: summarize a document of any length with a fixed-size KV cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from h2o_stream.apps.summarize.documents import Document, as_document, text_from_bytes
from h2o_stream.apps.summarize.settings import (
    DEFAULT_CACHE_SIZE,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_INSTRUCTION,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_NO_REPEAT_NGRAM_SIZE,
    DEFAULT_POLICY,
    DEFAULT_REPETITION_PENALTY,
    DEFAULT_SECTION_MAX_NEW_TOKENS,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_P,
    STRATEGIES,
    check_settings,
)
from h2o_stream.apps.summarize.text import Unwrap, ends_a_sentence, unwrap
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import atomic_path
from h2o_stream.loading.corpus import SAMPLE

from .options import SEEDS, at_least, cache_options, model_options


@click.command("summarize")
@click.argument("file", metavar="FILE")
@click.option(
    "--book",
    default=None,
    metavar="INDEX_OR_TITLE",
    help="For a corpus of several books (a PG-19 .jsonl, a directory, 'sample'): the one to summarize, by "
    "index or (part of its) title.",
)
@click.option(
    "--strategy",
    type=click.Choice(STRATEGIES),
    default="single",
    show_default=True,
    help="single: stream the whole document into the cache, then summarize. hierarchical: summarize "
    "sections, then the summaries.",
)
@click.option("--instruction", default=DEFAULT_INSTRUCTION, show_default=True, help="What to ask for.")
@click.option("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, show_default=True, callback=at_least(1))
@click.option(
    "--chunk-size",
    type=int,
    default=DEFAULT_CHUNK_SIZE,
    show_default=True,
    callback=at_least(1),
    help="Tokens per forward pass while reading (1 = exact, token by token).",
)
@click.option(
    "--section-tokens",
    type=int,
    default=None,
    callback=at_least(1),
    help="hierarchical: tokens per section (default: the cache size).",
)
@click.option(
    "--section-max-new-tokens",
    type=int,
    default=DEFAULT_SECTION_MAX_NEW_TOKENS,
    show_default=True,
    callback=at_least(1),
    help="hierarchical: length limit of each section summary.",
)
@click.option(
    "--temperature", type=float, default=DEFAULT_TEMPERATURE, show_default=True, help="0 = greedy (deterministic)."
)
@click.option(
    "--top-p", type=float, default=DEFAULT_TOP_P, show_default=True, help="Nucleus sampling (temperature > 0)."
)
@click.option("--seed", type=SEEDS, default=None, help="Seed for sampling (with --temperature > 0), 0 to 2**64-1.")
@click.option(
    "--repetition-penalty", type=float, default=DEFAULT_REPETITION_PENALTY, show_default=True, help="1 = off."
)
@click.option(
    "--no-repeat-ngram-size",
    type=int,
    default=DEFAULT_NO_REPEAT_NGRAM_SIZE,
    show_default=True,
    help="No n-gram of this many tokens twice in a summary; 0 = off.",
)
@click.option(
    "--out",
    "out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Also write the summary to this file (e.g. summary.md).",
)
@click.option("--show-sections", is_flag=True, help="hierarchical: print each section summary as it is made.")
@click.option("-q", "--quiet", is_flag=True, help="No progress bar or statistics on stderr.")
@cache_options(DEFAULT_POLICY, DEFAULT_CACHE_SIZE)
@model_options
def summarize(
    file,
    book,
    strategy,
    instruction,
    max_new_tokens,
    chunk_size,
    section_tokens,
    section_max_new_tokens,
    temperature,
    top_p,
    seed,
    repetition_penalty,
    no_repeat_ngram_size,
    out,
    show_sections,
    quiet,
    policy,
    cache_size,
    parts,
    no_rolling,
    model_spec,
    dtype,
    device,
    threads,
):
    """Summarize FILE, however long, reading it through a fixed-size KV cache.

    FILE is a text file, a PG-19 .jsonl (with --book), 'sample' (the books shipped with h2o-stream, with --book), or
    '-' for stdin. The summary streams to stdout; progress and statistics go to stderr."""
    from h2o_stream.apps.progress import Bars
    from h2o_stream.apps.summarize import summarize as summarize_document
    from h2o_stream.generation.sampling import check_sampling

    # click's ranges let NaN through; the library would name the fields (top_p) rather than the options
    check_sampling(
        options=True,
        temperature=temperature,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        seed=seed,
    )
    check_settings(
        strategy=strategy,
        instruction=instruction,
        max_new_tokens=max_new_tokens,
        policy=policy,
        cache_size=cache_size,
        chunk_size=chunk_size,
        section_tokens=section_tokens,
        section_max_new_tokens=section_max_new_tokens,
        options=True,
        parts=parts,
    )
    target = None if out is None else out_path(out, file)
    if file == "-":
        if book is not None:
            raise H2OStreamError("--book needs a corpus (a file, a directory or 'sample'), not stdin")
        data = getattr(sys.stdin, "buffer", sys.stdin).read()
        text = data if isinstance(data, str) else text_from_bytes(data, "stdin")
        document = as_document(Document(text=text, title="stdin"))
    else:
        document = as_document(Path(file) if file != "sample" else file, book=book)  # fails here, before the model

    bars = None if quiet else Bars(leave=False)  # a bad H2O_STREAM_PROGRESS_EVERY fails here, before the model

    def progress(done: int, total: int) -> None:
        assert bars is not None  # progress is reported unless --quiet
        bars.update("reading", done, total)
        if done >= total:
            bars.finish("reading")

    def section(part) -> None:
        if show_sections:
            click.echo(
                f"[level {part.level} part {part.index + 1}, tokens {part.start}-{part.end}] {part.text}\n", err=True
            )

    def warn(text: str) -> None:
        click.echo(f"warning: {text}", err=True)

    paragraphs = Unwrap()  # the model's line breaks inside a paragraph become spaces

    def text(piece: str) -> None:
        click.echo(paragraphs.push(piece), nl=False)
        sys.stdout.flush()

    if not quiet:
        click.echo(
            f"summarizing {document.title or 'the document'} ({strategy}, {policy} cache {cache_size})", err=True
        )
    result = summarize_document(
        document,
        model_spec,
        policy=policy,
        cache_size=cache_size,
        chunk_size=chunk_size,
        max_new_tokens=max_new_tokens,
        instruction=instruction,
        strategy=strategy,
        section_tokens=section_tokens,
        section_max_new_tokens=section_max_new_tokens,
        rolling=not no_rolling,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        dtype=dtype,
        device=device,
        threads=threads,
        on_progress=None if quiet else progress,
        on_text=text,
        on_section=section if strategy == "hierarchical" else None,
        on_warning=warn,
        **parts,
    )
    if bars is not None:
        bars.close()
    click.echo(paragraphs.finish())
    summary = unwrap(result.text)
    if result.stop_reason == "length" and not ends_a_sentence(summary):
        click.echo(
            f"note: the summary stopped at --max-new-tokens {max_new_tokens}, in the middle of a sentence; "
            "a larger --max-new-tokens lets it finish",
            err=True,
        )
    if target is not None:
        try:
            with atomic_path(target) as partial:
                partial.write_text(summary + "\n", encoding="utf-8")
        except OSError as error:
            raise H2OStreamError(f"cannot write {out}: {error.strerror or error}") from None
    if not quiet:
        policy_text = " ".join(f"{k}={v}" for k, v in result.policy.items() if k != "policy")
        sections = f", {len(result.sections)} section summaries" if result.sections else ""
        click.echo(
            f"read {result.tokens_read:,} document tokens ({result.tokens_fed:,} fed in all, "
            f"{result.tokens_per_second:.0f} tok/s) with {result.policy['policy']} {policy_text}"
            f"{sections}; {result.evictions:,} cache entries evicted; peak {result.peak_slots} per layer & KV head; "
            f"{result.tokens_generated} tokens generated ({result.stop_reason}); {result.seconds:.1f} s"
            + (f"; wrote {out}" if out is not None else ""),
            err=True,
        )


def out_path(out: Path, source: str) -> Path:
    """Where --out writes (through a symbolic link, to the file it points to); refused, before any work, when its
    directory is missing or when it is the document being summarized (the same file, also through a link) or a file
    of the corpus directory being read: the summary would replace what it summarizes."""
    target = out.expanduser().resolve()
    if not target.parent.is_dir():
        raise H2OStreamError(f"cannot write {out}: directory {out.parent} does not exist")
    read = Path(source).expanduser()
    if source in ("-", SAMPLE) or not target.exists() or not read.exists():
        return target
    if read.is_dir():
        if target.is_relative_to(read.resolve()):
            raise H2OStreamError(
                f"--out {out} is a file of the corpus directory {source} that is being summarized: "
                "the summary would replace it; choose another --out"
            )
    elif os.path.samefile(target, read):
        raise H2OStreamError(
            f"--out {out} is the file being summarized ({source}): the summary would replace the "
            "document; choose another --out"
        )
    return target
