"""Runs of a sweep as the rows of one batch (`ppl --rows N`): one model forward per span serves them all.

The runs share the stream and are at the same place in it; each keeps its own cache, NLL, curve and checkpoint, and
each row of the batched forward attends over its own cache only (`engine.rows.RowsCache`), so every run's result
equals the run alone up to the float rounding of batched matrix products (tested: <= 1e-5 mean per-token NLL).
The forward's time is shared out equally, so each run's tok/s is the sweep's rate divided by its rows.
"""

from __future__ import annotations

import time

import torch

from h2o_stream.engine.rows import RowsCache
from h2o_stream.errors import H2OStreamError

from .run import PerplexityRun
from .stream import feed_stream

#: what runs riding together must share: the forwards are cut from these
SHARED = ("span", "position", "book", "book_start", "reset_per_book")


class RunRows:
    """`runs` (PerplexityRuns of one model, at the same stream position, with the same span) fed together."""

    def __init__(self, runs: list[PerplexityRun]):
        first = runs[0]
        differ = [name for name in SHARED if any(getattr(run, name) != getattr(first, name) for run in runs)]
        if differ or any(run.model is not first.model for run in runs):
            raise H2OStreamError(
                f"runs fed as rows of one batch must share the model, {', '.join(SHARED)}; these "
                f"differ in {', '.join(differ) or 'the model'}"
            )
        self.runs = runs
        self.model = first.model
        self.cache = RowsCache(first.model, [run.cache for run in runs])

    @property
    def position(self) -> int:
        return self.runs[0].position

    @property
    def span(self) -> int:
        return self.runs[0].span

    @property
    def book_start(self) -> int:
        return self.runs[0].book_start

    def start_book(self, index: int) -> None:
        for run in self.runs:
            run.start_book(index)

    @torch.no_grad()
    def feed_chunk(self, ids: torch.Tensor) -> None:
        """ids: (C,) tokens of one book, continuing the stream of every run."""
        started = time.perf_counter()
        batch = ids.to(self.model.device).unsqueeze(0).expand(len(self.runs), -1)
        logits = self.model(batch, cache=self.cache).logits
        for run, row in zip(self.runs, logits, strict=True):
            run.take_logits(ids, row)
        share = (time.perf_counter() - started) / len(self.runs)
        for run in self.runs:
            run.seconds += share

    def run(self, pieces, **callbacks) -> None:
        """Consume (book index, token ids) pieces of the stream (`feed_stream`'s callbacks)."""
        feed_stream(self, pieces, **callbacks)
