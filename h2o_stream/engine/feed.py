"""Feeding tokens through a StreamingCache: the loop every command shares (ppl, chat, summarize)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from .cache import StreamingCache


def chunks(ids: torch.Tensor, chunk_size: int) -> Iterator[torch.Tensor]:
    """(1, L) token ids in pieces of at most `chunk_size` (1 = exact, token-by-token mode)."""
    for start in range(0, ids.shape[-1], chunk_size):
        yield ids[..., start : start + chunk_size]


@torch.no_grad()
def feed(
    model,
    cache: StreamingCache,
    ids: torch.Tensor,
    chunk_size: int = 1,
    on_chunk: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """Run `ids` (1, L) through the model into `cache`, `chunk_size` tokens per forward; return the logits of the
    last token (vocab,), i.e. the prediction for what comes next. `on_chunk(chunk_ids, chunk_logits)` sees each
    chunk's logits (1, C, vocab) as it is computed, e.g. to score or to show progress.

    Once the cache holds entries, chunks are at most `cache.max_chunk` (a score-based policy's budget), the widest
    forward the cache takes on top of them; a prompt into an empty cache goes in `chunk_size` pieces as asked."""
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.shape[-1] == 0:
        raise ValueError("feed() needs at least one token")
    ids = ids.to(model.device)
    logits, start, limit = None, 0, cache.max_chunk
    while start < ids.shape[-1]:
        size = chunk_size if limit is None or cache.seen == 0 else min(chunk_size, limit)  # seen: slots would settle
        piece = ids[..., start : start + size]
        logits = model(piece, cache=cache, logits_to_keep=0 if on_chunk else 1).logits
        if on_chunk is not None:
            on_chunk(piece, logits)
        start += size
    assert logits is not None  # the loop ran: ids holds at least one token
    return logits[0, -1]
