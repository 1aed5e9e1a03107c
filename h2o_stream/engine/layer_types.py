"""Which policy each layer of a model runs, for models whose layers attend differently (`layer_types`,
`sliding_window`), and where each layer's tokens sit in a forward.

A sliding-window layer was trained to see its own last `W` keys (itself included: transformers' `kv > q - W`), so
it never needs more than `W - 1` entries between forwards. By default such a layer keeps exactly those (a window of
`W - 1`: the same keys the model gives it without a cache, bounded anyway), and the global layers run the chosen
policy at the budget; `sliding="policy"` runs the chosen policy on the sliding layers too, never wider than their
window. A model whose every layer slides (Mistral with a sliding window) has no global layer for the policy: there
every layer runs it (capped at the window). A window at least as long as the model's context never slides: such a
layer counts as global.
"""

from __future__ import annotations

from ..errors import H2OStreamError
from .policies import EvictionPolicy, make_policy

SLIDING_MODES = ("window", "policy")
_GLOBAL = "full_attention"
_SLIDING = "sliding_attention"


def layer_windows(config) -> list[int | None]:
    """Each layer's trained window (keys a query sees, itself included), or None for a global layer."""
    layers = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    context = getattr(config, "max_position_embeddings", None)
    if window is not None and context is not None and window >= context:
        window = None  # it never slides within the model's positions
    if types is None:  # no per-layer types: a sliding window, if any, applies to every layer (Mistral, Phi-3)
        return [window] * layers
    unknown = sorted(set(types) - {_GLOBAL, _SLIDING})
    if unknown:
        raise H2OStreamError(
            f"layers of type {', '.join(unknown)} are not supported (h2o-stream streams "
            f"{_GLOBAL} and {_SLIDING} layers)"
        )
    return [window if kind == _SLIDING else None for kind in types]


def layer_policies(policy: EvictionPolicy, windows: list[int | None], sliding: str = "window") -> list[EvictionPolicy]:
    """The policy of every layer (see the module docstring); layers that run the chosen policy get `policy` itself
    (or, with a per-layer schedule, the global layers their own budget: `EvictionPolicy.for_layers`; where every
    layer slides, every layer its own, capped at its window), the others one policy object per window size."""
    if sliding not in SLIDING_MODES:
        raise H2OStreamError(
            f"sliding layers keep their window or run the policy ({', '.join(SLIDING_MODES)}), not {sliding!r}"
        )
    all_slide = all(window is not None for window in windows)
    spread = all_slide and policy.layer_schedule is not None  # no global layer: the schedule spreads over all
    scheduled = iter(policy.for_layers(len(windows) if spread else sum(window is None for window in windows)))
    by_window: dict[int, EvictionPolicy] = {}
    out = []
    for window in windows:
        if window is None:
            out.append(next(scheduled))
            continue
        if spread:
            out.append(capped(next(scheduled), window - 1))
            continue
        if window not in by_window:
            runs_policy = sliding == "policy" or all_slide
            by_window[window] = capped(policy, window - 1) if runs_policy else make_policy("window", window - 1)
        out.append(by_window[window])
    return out


def capped(policy: EvictionPolicy, entries: int) -> EvictionPolicy:
    """`policy` keeping at most `entries` (a sliding layer's window - 1): itself if its budget fits, the full cache
    as a window, else the policy at that smaller budget (`EvictionPolicy.reduced`: each part keeps its share)."""
    if policy.budget is None:
        return make_policy("window", entries)
    return policy if policy.budget <= entries else policy.reduced(entries)


def token_slots(
    budget: int | None, held: int, fair: bool, length: int, blocks: list[int] | None
) -> range | tuple[int, ...]:
    """With rolling, the slot of every token of a forward of `length` tokens into a layer holding `held` entries:
    a fair chunk first cuts to budget + 1 - length; a scanned forward's blocks (`blocks`) each find n entries (after
    their fair cut), take slots n..n+C-1, and their cut leaves min(n + C, budget)."""
    if blocks is None:
        if not (fair and held):
            return range(held, held + length)
        assert budget is not None  # fair chunks are a bounded policy's (cache.py)
        n = min(held, budget + 1 - length)
        return range(n, n + length)
    assert budget is not None  # a scan, or compiled steps, runs only a bounded policy (cache.py)
    slots: list[int] = []
    n = held
    for size in blocks:
        if fair and n:
            n = min(n, budget + 1 - size)
        slots.extend(range(n, n + size))
        n = min(n + size, budget)
    return tuple(slots)
