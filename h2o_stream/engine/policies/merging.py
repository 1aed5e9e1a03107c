"""What a cut does with the entries it evicts when a policy declares `eviction = "merge"` (cam): each is merged into
the entries after it instead of dropped outright. Tensor functions; base.py calls them from the cut."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the policy registry loads this module without it
    import torch


def merge_evicted(
    values: torch.Tensor,
    positions: torch.Tensor,
    scores: torch.Tensor,
    kept: torch.Tensor,
    *,
    span: int,
    seed: int,
    layer: int,
) -> torch.Tensor:
    """`values` (batch, kv_heads, n, dim) after the entries not `kept` (bool, batch, kv_heads, n) are merged, oldest
    first: an evicted entry e whose latest attention a_e (`scores`, the latest query's, per KV head) is at least the
    mean attention m_e of the entries after it is merged with probability min(1, a_e / m_e), by its seeded coin
    (draws.entry_uniforms): v_e / span is added to each of the `span` entries after it (evicted ones included, which
    carry it on when their own turn comes). a_e = m_e = 0 never merges; m_e = 0 < a_e always does. A new tensor."""
    import torch

    from ..draws import entry_uniforms
    from ..switch import compiled_part

    n = positions.shape[-1]
    slot = torch.arange(n, device=positions.device)
    evicted = n - int(kept.sum(dim=-1).max())
    if evicted <= 0:
        return values
    order = torch.where(kept, n, slot).sort(dim=-1).values[..., :evicted]  # evicted slots, ascending
    attention = scores.to(torch.float64)
    after = attention.flip(-1).cumsum(-1).flip(-1) - attention  # attention summed over the entries after each
    # the evicted entries' chances and coins only (batch, kv_heads, evicted): the kept ones' are never read
    attention, after = attention.gather(-1, order), after.gather(-1, order)
    ratio = attention / (after / (n - 1 - order).clamp(min=1))
    chance = torch.nan_to_num(ratio, nan=0.0, posinf=1.0).clamp(max=1.0)
    coins = entry_uniforms(seed, layer, positions.gather(-1, order)) < chance  # whose coin says merge
    compiled = compiled_part("compiled_merge")
    if (
        compiled is not None
        and values.device.type == "cpu"
        and values.dtype in (torch.float32, torch.float64)
        and not values.requires_grad  # autograd goes through the tensor path
    ):
        return compiled.merge_in_order(values, order, coins, span)  # the same merges, one after another
    # Merging one after another, oldest first, is one linear map: with W[t, j] = (evicted entry j merges) / span for
    # the `span` slots t after it, the evicted values v' solve v' = v + L v' (L: W's rows at the evicted slots,
    # strictly lower triangular, since an entry only reaches those after it), and every value then gains W v'.
    # Half-precision values are merged in float32: the CPU's triangular solve takes no half types.
    work = torch.promote_types(values.dtype, torch.float32)
    weights = coins.to(work) / span  # (batch, kv_heads, evicted)
    distance = slot.view(1, 1, n, 1) - order.unsqueeze(-2)  # (batch, kv_heads, n, evicted)
    spread = ((distance > 0) & (distance <= span)).to(work) * weights.unsqueeze(-2)
    rows = order.unsqueeze(-1)
    carried = spread.gather(2, rows.expand(-1, -1, -1, evicted))  # (batch, kv_heads, evicted, evicted)
    leaving = values.gather(2, rows.expand(-1, -1, -1, values.shape[-1])).to(work)
    if evicted > 1:
        leaving = torch.linalg.solve_triangular(-carried, leaving, upper=False, unitriangular=True)
    return (values.to(work) + spread @ leaving).to(values.dtype)
