"""The token stream of a perplexity run: its (book index, token ids) pieces, where its forwards are cut, and the NLL of
every token.

`token_pieces` turns ids, a text or texts/Books into pieces, `select_books` keeps some books (or each book's first
tokens; `loading.corpus.parse_books` reads the --books list) and `skip_tokens_of` drops the stream's first tokens
(those a resumed run already fed). `feed_stream` cuts the pieces into forwards at multiples of the span (tokens per
forward; `forward_span`, `default_span`) of the stream position alone, so a resumed run makes exactly the forwards of an
uninterrupted one. `token_nll` is the per-token negative log-likelihood a run accumulates.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch

from h2o_stream.engine.cache import BAND_CHUNK, default_chunk_size
from h2o_stream.engine.policies import EvictionPolicy
from h2o_stream.errors import H2OStreamError


def feed_stream(
    run,
    pieces: Iterable[tuple[int, torch.Tensor]],
    *,
    limit: int | None = None,
    on_progress=None,
    checkpoint=None,
    before_cut_short=None,
) -> None:
    """Feed (book index, token ids) pieces of the stream to `run` (a PerplexityRun, or runs fed as the rows of one
    batch: anything with `position`, `span`, `book_start`, `start_book(index)` and `feed_chunk(ids)`) from its
    position on.

    Forwards are cut at multiples of the span of the stream position (per book with reset_per_book), so a resumed
    run makes exactly the forwards an uninterrupted one would. `on_progress(run, fed)` is called after every forward;
    `checkpoint(run)` after every forward an uninterrupted longer run would also make (all but a last one that
    `limit` cuts short: a state there would make a longer resumed run cut its forwards differently);
    `before_cut_short(run)` once, before such a last forward (a checkpoint taken there lets a longer run resume as
    if never stopped).
    """
    for index, ids in skip_tokens_of(pieces, run.position):
        run.start_book(index)
        offset = 0
        while offset < ids.numel():
            if limit is not None and run.position >= limit:
                return
            room = min(run.span - (run.position - run.book_start) % run.span, ids.numel() - offset)
            cut_short = limit is not None and limit - run.position < room
            if cut_short:
                if before_cut_short is not None:
                    before_cut_short(run)
                room = limit - run.position
            piece = ids[offset : offset + room]
            run.feed_chunk(piece)
            offset += piece.numel()
            if on_progress is not None:
                on_progress(run, piece.numel())
            if checkpoint is not None and not cut_short:
                checkpoint(run)


def select_books(
    pieces: Iterable[tuple[int, torch.Tensor]], books: Collection[int] | None = None, book_tokens: int | None = None
) -> Iterator[tuple[int, torch.Tensor]]:
    """The pieces of the books whose index is in `books` (None: every book), each cut to its first `book_tokens` tokens
    (None: whole): a stream over many books without reading each to its end, or over books apart from another's."""
    for index, ids in pieces:
        if books is None or index in books:
            yield index, ids if book_tokens is None else ids[:book_tokens]


def skip_tokens_of(pieces: Iterable[tuple[int, torch.Tensor]], count: int) -> Iterator[tuple[int, torch.Tensor]]:
    """Drop the first `count` tokens of the stream (already fed before a resume)."""
    for index, ids in pieces:
        if count >= ids.numel():
            count -= ids.numel()
            continue
        yield index, ids[count:]
        count = 0


def token_pieces(texts_or_ids, tokenizer=None) -> Iterator[tuple[int, torch.Tensor]]:
    """(book index, ids) from a 1-D tensor / list of ints (one book), or an iterable of texts or Books."""
    if isinstance(texts_or_ids, torch.Tensor):
        yield 0, texts_or_ids.reshape(-1).long()
        return
    if isinstance(texts_or_ids, list) and texts_or_ids and isinstance(texts_or_ids[0], int):
        yield 0, torch.tensor(texts_or_ids, dtype=torch.long)
        return
    if isinstance(texts_or_ids, str):
        texts_or_ids = [texts_or_ids]
    if tokenizer is None:
        raise H2OStreamError("texts need a tokenizer")
    for index, item in enumerate(texts_or_ids):
        text = getattr(item, "text", item)
        yield index, torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


#: rows of logits per cross-entropy call in `token_nll`
NLL_ROWS = 32


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood (T,) of `targets` (T,) under `logits` (T, vocab), in blocks of `NLL_ROWS`
    rows, so that a block's log-softmax stays in the CPU cache, where one call over a chunk's 256 x 49,152 logits would
    write and reread 50 MB; the values are the same bit for bit."""
    if targets.numel() <= NLL_ROWS:  # one block; also a chunk's first token alone, which predicts nothing (empty)
        return torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    return torch.cat(
        [
            torch.nn.functional.cross_entropy(logits[i : i + NLL_ROWS], targets[i : i + NLL_ROWS], reduction="none")
            for i in range(0, targets.numel(), NLL_ROWS)
        ]
    )


def forward_span(policy: EvictionPolicy, chunk_size: int | None, span: int | None) -> tuple[int, int]:
    """(chunk size, span) of a run: those given, else the policy's `default_chunk_size` and its `default_span`."""
    chunk_size = default_chunk_size(policy) if chunk_size is None else chunk_size
    return chunk_size, default_span(chunk_size) if span is None else span


def default_span(chunk_size: int) -> int:
    """Tokens per forward for a chunk size: the largest multiple of it up to 256 (at least the chunk itself). Measured
    on SmolLM2 at cache 256, one thread: h2o in fair chunks of 16 runs at 102 tok/s one forward per chunk and 219
    scanned in forwards of 256; exact mode at 14 and 77."""
    return chunk_size * max(1, BAND_CHUNK // chunk_size)
