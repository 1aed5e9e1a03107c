"""A fixed-budget KV cache that plugs into transformers as a `Cache`.

Per layer and KV head it holds at most `policy.budget` entries between forward passes. A forward of C tokens appends
their keys/values (slots n..n+C-1), the attention function attends over all n+C entries and reports how much attention
each entry received, and the layer then cuts back to the budget with the policy's choice of slots.

Invariants (per layer):
- keys/values/positions/scores share the slot axis; slots are in ascending stream order for every head;
- with rolling, `keys` are un-rotated and every head has the same n, so slot j is used at position j;
- without rolling, `keys` stay as the model rotated them, at their true stream positions.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import H2OStreamError
from ..rope_rolling import RopeRoller
from .hooks import attach
from .policies import EvictionPolicy


class StreamingLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self, policy: EvictionPolicy, roller: RopeRoller | None):
        super().__init__()
        self.policy = policy
        self.roller = roller
        self.positions: torch.Tensor | None = None  # (batch, kv_heads, n) stream index of each slot
        self.scores: torch.Tensor | None = None  # (batch, kv_heads, n) accumulated attention, if the policy uses it
        self.seen = 0  # tokens this layer has been given
        self.evicted = 0  # entries cut, summed over heads
        self._rows_memo: dict[tuple[int, int, int], torch.Tensor] = {}

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.positions = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)
        # float64 so that long sums of small probabilities rank entries stably (MPS has no float64).
        score_dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.scores = torch.empty(batch, heads, 0, dtype=score_dtype, device=self.device)
        self.is_initialized = True

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        """Append C new entries (rotated by the model at slots n..n+C-1) and return what attention should use."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, c = self.slots, key_states.shape[-2]
        if self.roller is not None:
            key_states = self.roller.unrotate(key_states, n, n + c)
        batch, heads = self.positions.shape[:2]
        new_positions = torch.arange(self.seen, self.seen + c, device=self.device).expand(batch, heads, c)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.positions = torch.cat([self.positions, new_positions], dim=-1)
        self.scores = torch.nn.functional.pad(self.scores, (0, c))
        self.seen += c
        keys = self.keys if self.roller is None else self.roller.rotate(self.keys, 0, n + c)
        return keys, self.values

    def after_attention(self, received: torch.Tensor | None) -> None:
        """Add the attention each entry just received (batch, kv_heads, n), then cut back to the budget."""
        if received is not None:
            self.scores += received
        budget = self.policy.budget
        if budget is None or self.slots <= budget:
            return
        rows = self._kept_rows(budget)
        self.evicted += self.positions.numel() - rows.numel()
        self.keys = _take(self.keys, rows, budget)
        self.values = _take(self.values, rows, budget)
        self.positions = _take(self.positions, rows, budget)
        self.scores = _take(self.scores, rows, budget)

    def _kept_rows(self, budget: int) -> torch.Tensor:
        """The policy's kept slots as rows of the flattened (batch*heads*slots) storage.

        Band policies (sink, window) keep the same slots whenever the cache holds the same number of entries, so
        their answer is memoised: in steady state it is one dictionary lookup per layer and step.
        """
        batch, heads, slots = self.positions.shape
        memo_key = (batch, heads, slots)
        if self.policy.band() is not None and memo_key in self._rows_memo:
            return self._rows_memo[memo_key]
        keep = self.policy.keep(self.positions, self.scores if self.policy.needs_scores else None)
        offsets = torch.arange(batch * heads, device=keep.device).view(batch, heads, 1) * slots
        rows = (keep + offsets).reshape(-1)
        if self.policy.band() is not None:
            self._rows_memo[memo_key] = rows
        return rows

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.slots + query_length, 0

    def get_seq_length(self) -> int:
        # Tokens seen, as for transformers' sliding-window layers: `generate` slices its inputs by it.
        return self.seen

    def get_max_length(self) -> int:
        budget = self.policy.budget
        return -1 if budget is None else budget

    def reset(self) -> None:
        self.keys = self.values = self.positions = self.scores = None
        self.is_initialized = False
        self.seen = self.evicted = 0

    def state(self) -> dict:
        """A snapshot (copies: scores are updated in place by later forwards)."""
        state = {k: getattr(self, k) for k in ("keys", "values", "positions", "scores", "seen", "evicted")}
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_state(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.is_initialized = self.keys is not None
        if self.is_initialized:
            self.device = self.keys.device


def _take(x: torch.Tensor, rows: torch.Tensor, kept: int) -> torch.Tensor:
    """x (batch, heads, slots, *rest) at the kept slots. index_select on a flat view: CPU gather is ~10x slower."""
    batch, heads, slots = x.shape[:3]
    return x.reshape(batch * heads * slots, *x.shape[3:]).index_select(0, rows).view(batch, heads, kept, *x.shape[3:])


class StreamingCache(Cache):
    """Fixed-budget cache for `model`: pass it as `cache=` to a forward or to `model.generate`.

    Construction attaches h2o-stream to the model (attention function + two hooks, once per model); the cache then
    owns position ids: with rolling they are slot indices, without rolling true stream positions.
    """

    def __init__(self, model, policy: EvictionPolicy, *, rolling: bool = True):
        config = model.config.get_text_config(decoder=True)
        roller = RopeRoller.for_model(model) if rolling else None
        budget = policy.budget
        context = getattr(config, "max_position_embeddings", None)
        if rolling and budget is not None and context is not None and budget + 1 > context:
            raise H2OStreamError(
                f"cache size {budget} does not fit the model's context of {context} positions "
                f"(a step needs budget + 1 positions); use a cache size of at most {context - 1}")
        layer_types = getattr(config, "layer_types", None) or []
        if any(t != "full_attention" for t in layer_types):
            raise H2OStreamError(f"models with non-global attention layers ({sorted(set(layer_types))}) "
                                 "are not supported")
        super().__init__(layers=[StreamingLayer(policy, roller) for _ in range(config.num_hidden_layers)])
        self.policy = policy
        self.rolling = rolling
        self.context = context
        attach(model)

    @property
    def slots(self) -> int:
        """Entries per KV head now held (the same in every layer)."""
        return self.layers[0].slots

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def evicted(self) -> int:
        return sum(layer.evicted for layer in self.layers)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        # The mask is built in slot space: queries sit right after the n cached entries.
        return self.layers[layer_idx].slots

    def begin_forward(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids for the next `length` tokens, and the banded mask chunked mode needs (or None)."""
        start = self.slots if self.rolling else self.seen
        if self.rolling and self.context is not None and start + length > self.context:
            raise H2OStreamError(
                f"a chunk of {length} tokens on top of {start} cached entries needs positions up to "
                f"{start + length - 1}, beyond the model's context of {self.context}; use a smaller chunk or cache")
        positions = torch.arange(start, start + length, device=device).unsqueeze(0)
        return positions, self.band_mask(length, device)

    def band_mask(self, length: int, device) -> torch.Tensor | None:
        """For sink/window: query i (slot n+i) sees slots j <= n+i with j < sinks or j >= n+i-recent, exactly the
        keys exact mode would give it. (batch 1, 1, length, n+length) bool, True = attend."""
        band = self.policy.band()
        if band is None or length == 1:
            return None
        sinks, recent = band
        n = self.slots
        query_slot = torch.arange(n, n + length, device=device).unsqueeze(-1)
        key_slot = torch.arange(n + length, device=device)
        visible = (key_slot <= query_slot) & ((key_slot < sinks) | (key_slot >= query_slot - recent))
        return visible[None, None]

    def state(self) -> dict:
        return {"policy": self.policy.settings(), "rolling": self.rolling,
                "layers": [layer.state() for layer in self.layers]}

    def load_state(self, state: dict) -> None:
        if state["policy"] != self.policy.settings() or state["rolling"] != self.rolling:
            raise H2OStreamError(f"saved cache was made with {state['policy']} (rolling={state['rolling']}), "
                                 f"not {self.policy.settings()} (rolling={self.rolling})")
        if len(state["layers"]) != len(self.layers):
            raise H2OStreamError(f"saved cache has {len(state['layers'])} layers, this model {len(self.layers)}")
        for layer, layer_state in zip(self.layers, state["layers"]):
            layer.load_state(layer_state)
