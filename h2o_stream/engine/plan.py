"""The plan of a forward: what the cache decides before the model runs, and each layer's part of it.

`StreamingCache.check_forward` checks a forward and returns its `ForwardPlan`; `start_forward` hands every layer its
`LayerPlan` (`StreamingLayer.begin`), which the layer keeps, unchanged, until the next forward's. Nothing in a plan
changes while the forward runs: what does (the entries, the cuts) is the layer's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeAlias

import torch

#: a forward's positions, or a layer's own slots for its tokens: one range, or one slot per token (a scan)
Slots: TypeAlias = range | tuple[int, ...]


@dataclass(frozen=True)
class LayerPlan:
    """One layer's part of a forward of `length` tokens (the defaults: one decision, nothing moved)."""

    length: int
    #: block sizes when the forward decides per block (a scan, or exact mode's one-token steps), else None
    blocks: tuple[int, ...] | None = None
    #: fair chunks: the forward (or each block) first makes room, and its last cut may wait for the next (layer.py)
    fair: bool = False
    #: the blocks are exact mode's one-token steps for the compiled loop (engine/compiled.py)
    compiled: bool = False
    #: (the positions the model rotates the tokens at, this layer's own slots for them), when they differ: a layer
    #: running another policy than the lead layer's (a sliding window) has slots of its own
    moved: tuple[Slots, Slots] | None = None
    #: (batch, length) the forward's token ids, for a policy that reads them (`needs_tokens`), else None
    tokens: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardPlan:
    """A checked forward: the positions the model is given (the lead layer's slots with rolling, else the stream's
    positions) and every layer's part, in layer order."""

    positions: Slots
    layers: tuple[LayerPlan, ...]
