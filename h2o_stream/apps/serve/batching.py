"""Continuous batching: the forward passes of every turn under way run as the rows of one batch.

Each turn runs in its own greenlet on the model worker's thread, with the model it sees wrapped in a `BatchedModel`.
Wherever the turn's code (a chat session, the decode loop) calls the model, the greenlet hands the forward to the
worker (`Forward`) and is suspended until its logits come back. Once every turn under way has reached its next
forward (or ended), the worker runs them together (`run_forwards`): those of the same length (every decode step, a
token each; prompt chunks of one size) as one batch of `RowsCache` rows, each row over its own cache, the rest one by
one. So a turn joins the batch at its first forward and leaves it at its last, every turn advances one forward per
round, and no code above the model knows it is batched. One thread and no locks: greenlets switch only at forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import greenlet
import torch

from h2o_stream.engine import RowsCache
from h2o_stream.errors import H2OStreamError


@dataclass
class Forward:
    """A forward a turn asked for: its token ids (1, length) into `cache`, the logits of the last `keep` tokens (0:
    all) wanted back."""

    ids: torch.Tensor
    cache: object
    keep: int


class BatchedModel:
    """`model` as a turn sees it: a call inside a turn's greenlet is handed to the worker (see the module docstring);
    anywhere else it runs at once. Everything else (config, embeddings, ...) is the model's own."""

    def __init__(self, model):
        self.model = model

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def __call__(self, ids: torch.Tensor, *, cache, logits_to_keep: int = 0):
        hub = greenlet.getcurrent().parent
        if hub is None:  # not inside a turn: nothing to batch with
            return self.model(ids, cache=cache, logits_to_keep=logits_to_keep)
        return hub.switch(Forward(ids, cache, logits_to_keep))


def run_forwards(model, forwards: list[Forward], *, batch: bool = True) -> list[object]:
    """Each forward's output (an object with `.logits`, as the model's), or the exception it raised. With `batch`,
    forwards of the same shape run as the rows of one batch. A row that does not fit its cache is refused before any
    cache changes (`RowsCache`): that batch then runs row by row, so the error lands on the turn that caused it."""
    results: list[object] = [None] * len(forwards)
    groups: dict[tuple, list[int]] = {}
    for index, forward in enumerate(forwards):
        key = (forward.ids.shape[-1], forward.keep) if batch else (index,)
        groups.setdefault(key, []).append(index)
    for indices in groups.values():
        if len(indices) > 1:
            try:
                rows = RowsCache(model, [forwards[i].cache for i in indices])
                ids = torch.cat([forwards[i].ids for i in indices])
                logits = model(ids, cache=rows, logits_to_keep=forwards[indices[0]].keep).logits
            except H2OStreamError:  # a row that does not fit, refused before any cache changed: each alone below
                pass
            except Exception as error:  # noqa: BLE001 - during the forward: every row's turn fails (and rolls back)
                for i in indices:
                    results[i] = error
                continue
            else:
                for row, i in enumerate(indices):
                    results[i] = SimpleNamespace(logits=logits[row : row + 1])
                continue
        for i in indices:
            try:
                results[i] = model(forwards[i].ids, cache=forwards[i].cache, logits_to_keep=forwards[i].keep)
            except Exception as error:  # noqa: BLE001 - handed to the turn that asked, which fails alone
                results[i] = error
    return results
