"""Several streaming caches as the rows of one batch: one model forward serves several runs.

`RowsCache(model, caches)` holds one `StreamingCache` per batch row, each with its own policy, budget, chunking
(`decide_every`) and rolling. The model runs the whole batch at once (embeddings, projections, MLPs, the head), and
inside each layer the attention function takes the rows one at a time: row r attends over its own cache exactly as
its cache alone would (its positions, mask, scores, cuts, scan blocks). So row r's logits equal a forward of row r
alone with its cache, up to the float rounding of the batched matrix products.

Invariants: the rows are distinct caches made for this model; a forward brings one row of tokens per cache (in a
sweep every row gets the same tokens, but nothing here needs that); every row's forward is checked before any row is
changed, so a misfit is one clear H2OStreamError with every cache untouched.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import H2OStreamError
from .cache import StreamingCache
from .hooks import active_cache, attach
from .layer import StreamingLayer


class RowsLayer(CacheLayerMixin):
    """One model layer of a `RowsCache`: the rows' `StreamingLayer`s, and what each row's queries attend to in the
    forward now running (`attend_to`: its keys and values; each row's layer makes its own mask)."""

    is_sliding = False
    is_croppable = False

    def __init__(self, rows: list[StreamingLayer]):
        super().__init__()
        self.rows = rows
        self.attend_to: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(rows)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True  # the rows initialise themselves

    def update(self, key_states, value_states, *args, **kwargs):
        """Give each row its own row of the new entries; the attention function reads `attend_to`."""
        self.attend_to = [row.update(key_states[i : i + 1], value_states[i : i + 1]) for i, row in enumerate(self.rows)]
        return key_states, value_states

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # The attention function builds each row's mask itself; this only sizes the one transformers makes.
        return max(row.slots for row in self.rows) + query_length, 0

    def get_seq_length(self) -> int:
        return max(row.seen for row in self.rows)

    def get_max_length(self) -> int:
        lengths = [row.get_max_length() for row in self.rows]
        return -1 if -1 in lengths else max(lengths)  # -1: no maximum (transformers' word), if any row has none

    def reset(self) -> None:
        for row in self.rows:
            row.reset()
        self.attend_to = [None] * len(self.rows)


class RowsCache(Cache):
    """`caches` (one `StreamingCache` per batch row) as one cache for a batched forward of `model`: pass it as
    `cache=` with input ids of shape (len(caches), length). Each cache keeps working on its own afterwards."""

    def __init__(self, model, caches: list[StreamingCache]):
        if not caches:
            raise H2OStreamError("a RowsCache needs at least one StreamingCache")
        if len({id(cache) for cache in caches}) != len(caches):
            raise H2OStreamError("each row of a RowsCache needs its own StreamingCache; one was given twice")
        for cache in caches:
            cache._check_model(model.base_model)
        self.caches = caches
        super().__init__(
            layers=[RowsLayer([cache.layers[i] for cache in caches]) for i in range(len(caches[0].layers))]
        )
        attach(model)

    def begin_forward(
        self,
        inputs: torch.Tensor,
        *,
        model=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Each row's position ids (stacked) for the forward about to run (each row's layers make their own masks).
        Every row is checked first (`StreamingCache.check_forward`), then each starts with its plan."""
        if inputs.shape[0] != len(self.caches):
            raise H2OStreamError(
                f"this RowsCache has {len(self.caches)} rows and the forward brings a batch of "
                f"{inputs.shape[0]}: pass one row of tokens per cache"
            )

        def row(tensor, i):
            return None if tensor is None else tensor[i : i + 1]

        plans = [
            cache.check_forward(
                inputs[i : i + 1], model=model, position_ids=row(position_ids, i), attention_mask=row(attention_mask, i)
            )
            for i, cache in enumerate(self.caches)
        ]
        positions = [
            cache.start_forward(inputs[i : i + 1], plan)[0]
            for i, (cache, plan) in enumerate(zip(self.caches, plans, strict=True))
        ]
        return torch.cat(positions), None

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' `Cache.update`, only from a forward h2o-stream has set up (see `attach`)."""
        if active_cache() is not self:
            raise H2OStreamError("this RowsCache is being filled by a forward that h2o-stream did not set up")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        for cache in self.caches:
            cache.reset()
