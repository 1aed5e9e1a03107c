"""Slot arithmetic the policies share: which slots to keep, given ranks, counts and the protected ends of a layer's
entries (each (batch, kv_heads, n), n slots in stream order). Ties go to the older entry throughout."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the policy registry loads this module without it
    import torch

from ..memo import memoised
from ..switch import compiled_part


def at_slots(x: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x (batch, heads, n, *rest) at `slots` (batch, heads, m) of its slot axis: (batch, heads, m, *rest)."""
    index = slots.view(*slots.shape, *(1,) * (x.dim() - 3)).expand(*slots.shape, *x.shape[3:])
    return x.gather(2, index)


def ages(positions: torch.Tensor) -> torch.Tensor:
    """Steps each entry has been in the cache, its arrival step included (the newest entry: 1), same shape."""
    return positions[..., -1:] - positions + 1


def top_slots(ranks: torch.Tensor, count: int, start: int = 0, *, in_slot_order: bool = True) -> torch.Tensor:
    """Ascending slots of the `count` highest `ranks` (batch, heads, m), offset by `start` (the slot of ranks[0]);
    equal ranks go to the lower slot, i.e. the older entry. `in_slot_order=False`: the same slots in any order (for a
    caller that only marks them), one sort fewer."""
    import torch

    m = ranks.shape[-1]
    if count == m - 1:
        top = _all_but(_lowest_last(ranks), m, ranks)
        return top + start if start else top
    # A stable descending sort keeps equal ranks in slot (= stream) order, so ties favour the older entry.
    top = torch.sort(ranks, dim=-1, descending=True, stable=True).indices[..., :count]
    if in_slot_order:
        top = top.sort(dim=-1).values
    return top + start if start else top


def keep_top(ranks: torch.Tensor, count: int, *, sinks: int, recent: int) -> torch.Tensor:
    """What most scored policies keep: the first `sinks` slots, the `count` highest `ranks` among the slots between
    them and the last `recent` (ranks (batch, heads, m) covers exactly those m), and the last `recent`; ascending.
    Ties as in `top_slots`. Compiled on the CPU where the cut drops few (engine/compiled_cuts.py, the same slots)."""
    import torch

    m = ranks.shape[-1]
    n = sinks + m + recent
    if count == m - 1:
        # Exact mode's usual cut, one entry: every slot but the dropped one, without assembling three parts.
        drop = _lowest_last(ranks)
        return _all_but(drop + sinks if sinks else drop, n, ranks)
    compiled = compiled_part("compiled_cuts")
    if (
        compiled is not None
        and ranks.device.type == "cpu"
        and ranks.dtype in (torch.float64, torch.float32, torch.int64)  # what numpy reads (no bfloat16)
        and 0 < m - count <= compiled.FEW
    ):
        # A fair chunk's cut drops a chunk's worth: those few found in one pass, not two sorts of every rank.
        return compiled.keep_highest(ranks, count, sinks, recent)
    parts = [first_slots(sinks, ranks)] if sinks else []
    parts += [top_slots(ranks, count, start=sinks), last_slots(n, recent, ranks)]
    return torch.cat(parts, dim=-1)


def _lowest_last(ranks: torch.Tensor) -> torch.Tensor:
    """(batch, heads, 1): the slot of the lowest rank, of equal lowest ranks the newest (argmin of the flipped ranks
    finds the last). Two sorts per layer and step were a tenth of the cache's time per token."""
    return (ranks.shape[-1] - 1) - ranks.flip(-1).argmin(dim=-1, keepdim=True)


def _all_but(drop: torch.Tensor, n: int, like: torch.Tensor) -> torch.Tensor:
    """Slots 0..n-1 without `drop` (batch, heads, 1), ascending: (batch, heads, n - 1)."""
    slots = slot_range(0, n - 1, like)
    return slots + (slots >= drop)


def first_slots(count: int, like: torch.Tensor) -> torch.Tensor:
    """Slot indices 0..count-1 broadcast to like's (batch, kv_heads) shape: where the stream's first `count` tokens
    sit once a policy that always keeps them has cut at least once."""
    return slot_range(0, count, like)


def last_slots(n: int, count: int, like: torch.Tensor) -> torch.Tensor:
    """Slot indices n-count..n-1 broadcast to like's (batch, kv_heads) shape."""
    return slot_range(n - count, n, like)


def slot_range(start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    """Slot indices start..stop-1 broadcast to like's (batch, kv_heads) shape. Memoised (every layer and step asks
    for the same few): never modify the result in place."""
    return _slot_range(start, stop, tuple(like.shape[:2]), like.device)


@memoised(256)
def _slot_range(start: int, stop: int, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    import torch

    return torch.arange(start, stop, device=device).expand(*shape, stop - start)
