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

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import H2OStreamError
from ..rope_rolling import RopeRoller
from .hooks import active_cache, attach
from .policies import EvictionPolicy


class StreamingLayer(CacheLayerMixin):
    is_sliding = False
    is_croppable = False

    def __init__(self, policy: EvictionPolicy, roller: RopeRoller | None):
        super().__init__()
        self.policy = policy
        self.roller = roller
        self.positions: torch.Tensor | None = None  # (batch, kv_heads, n) stream index of each slot
        self.scores: torch.Tensor | None = None  # (batch, kv_heads, n) attention scores, if the policy uses them
        self.tokens: torch.Tensor | None = None  # (batch, kv_heads, n) token ids, if the policy reads them
        self.pending_tokens: torch.Tensor | None = None  # (batch, C) ids of the forward now running (needs_tokens)
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
        if self.policy.needs_tokens:
            self.tokens = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)
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
        if self.tokens is not None:
            new_tokens = self.pending_tokens.to(self.device).unsqueeze(1).expand(batch, heads, c)
            self.tokens = torch.cat([self.tokens, new_tokens], dim=-1)
        self.seen += c
        keys = self.keys if self.roller is None else self.roller.rotate(self.keys, 0, n + c)
        return keys, self.values

    def after_attention(self, received: torch.Tensor | None) -> None:
        """Fold the attention each entry just received (batch, kv_heads, n) into the scores (the policy's
        `update_scores`), then cut back to the budget."""
        if received is not None:
            self.policy.update_scores(self.scores, received)
        budget = self.policy.budget
        if budget is None or self.slots <= budget:
            return
        rows = self._kept_rows(budget)
        self.evicted += self.positions.numel() - rows.numel()
        self.keys = _take(self.keys, rows, budget)
        self.values = _take(self.values, rows, budget)
        self.positions = _take(self.positions, rows, budget)
        self.scores = _take(self.scores, rows, budget)
        if self.tokens is not None:
            self.tokens = _take(self.tokens, rows, budget)

    def _kept_rows(self, budget: int) -> torch.Tensor:
        """The policy's kept slots as rows of the flattened (batch*heads*slots) storage.

        Band policies (sink, window) keep the same slots whenever the cache holds the same number of entries, so
        their answer is memoised: in steady state it is one dictionary lookup per layer and step.
        """
        batch, heads, slots = self.positions.shape
        memo_key = (batch, heads, slots)
        if self.policy.band() is not None and memo_key in self._rows_memo:
            return self._rows_memo[memo_key]
        policy = self.policy
        extra = {}
        if policy.needs_keys:
            extra["keys"] = self.keys
        if policy.needs_tokens:
            extra["tokens"] = self.tokens
        keep = policy.keep(self.positions, self.scores if policy.needs_scores else None, **extra)
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
        self.keys = self.values = self.positions = self.scores = self.tokens = None
        self.is_initialized = False
        self.seen = self.evicted = 0

    def state(self) -> dict:
        """A snapshot (copies: scores are updated in place by later forwards)."""
        names = ("keys", "values", "positions", "scores", "seen", "evicted")
        state = {k: getattr(self, k) for k in (*names, "tokens") if k in names or self.policy.needs_tokens}
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_state(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        self.is_initialized = self.keys is not None
        if self.is_initialized:
            self.device = self.keys.device


def _model_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim): what a cache's storage is shaped by."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _continues(position_ids: torch.Tensor, seen: int, length: int) -> bool:
    """Whether every row of `position_ids` is seen..seen+length-1."""
    if position_ids.shape[-1] != length:
        return False
    expected = torch.arange(seen, seen + length, device=position_ids.device)
    return torch.equal(position_ids, expected.expand_as(position_ids))


def _describe(shape: tuple[int, int, int]) -> str:
    layers, heads, head_dim = shape
    return f"{layers} layers, {heads} KV heads of dimension {head_dim}"


def _check_attention_mask(attention_mask: torch.Tensor | None) -> None:
    """Refuse padding: the cache keeps, scores and positions every token as a real one, and chunked sink/window
    replace the mask with their band, so a padded batch would give silently wrong output."""
    if attention_mask is None:
        return
    if attention_mask.dim() != 2:
        raise H2OStreamError("a StreamingCache builds the attention mask itself: pass no attention_mask, or a 2D "
                             f"padding mask of ones, not a {attention_mask.dim()}D mask")
    if not bool(attention_mask.all()):
        raise H2OStreamError(
            "padded batches are not supported: the attention_mask has zeros, and a StreamingCache would keep, "
            "score and position the padding as real tokens. Batch streams of equal length, or run them one at a time")


def _take(x: torch.Tensor, rows: torch.Tensor, kept: int) -> torch.Tensor:
    """x (batch, heads, slots, *rest) at the kept slots. index_select on a flat view: CPU gather is ~10x slower."""
    batch, heads, slots = x.shape[:3]
    return x.reshape(batch * heads * slots, *x.shape[3:]).index_select(0, rows).view(batch, heads, kept, *x.shape[3:])


class StreamingCache(Cache):
    """Fixed-budget cache for `model`: pass it as `cache=` to a forward or to `model.generate`.

    Construction attaches h2o-stream to the model (attention function + two hooks, once per model); the cache then
    owns position ids: with rolling they are slot indices, without rolling true stream positions. It serves that one
    model and one batch of unpadded streams; anything else is refused before the model runs (see `begin_forward`).
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
        # The model it was made for (its rotary tables and shapes are baked in); weak, so the cache never keeps it.
        self._model = weakref.ref(model.base_model)
        self._model_shape = _model_shape(config)

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

    @property
    def max_chunk(self) -> int | None:
        """The most tokens one forward may add on top of cached entries (None: no limit from the policy).

        A policy without a band (h2o and every other policy that decides once per chunk) in chunked mode lets every
        query of a chunk see the n cached entries and its chunk predecessors; with a chunk wider than the budget that
        is far more than the budget + 1 keys exact mode gives a query, so its numbers stop meaning anything (a
        1-entry h2o cache would beat every other policy). Band policies (sink, window) mask each query down to
        exactly what exact mode gives it, so they take any chunk.
        """
        return None if self.policy.band() is not None else self.policy.budget

    def check_chunk_size(self, chunk_size: int) -> None:
        """Refuse (H2OStreamError) a chunk size wider than `max_chunk`; apps call it up front, before any work."""
        limit = self.max_chunk
        if limit is not None and chunk_size > limit:
            raise H2OStreamError(
                f"{self.policy.describe()} decides what to keep once per chunk, and a chunk of "
                f"{chunk_size} tokens over a cache of {limit} lets its queries see up to {limit + chunk_size} keys "
                f"instead of {limit + 1}: its results would not be comparable. Use a chunk size of at most the cache "
                f"size ({limit}), a larger cache, or exact (token-by-token) mode")

    def check_fits(self, tokens: int) -> None:
        """Refuse (H2OStreamError) `tokens` more stream tokens whose positions would pass the model's context.

        Only without rolling: tokens then sit at their true stream positions, so a stream can outrun the model's
        position table (an IndexError deep in the model otherwise). begin_forward checks every forward; an app may
        call this up front with the length of a whole stream.
        """
        if self.rolling or self.context is None or self.seen + tokens <= self.context:
            return
        left = max(self.context - self.seen, 0)
        raise H2OStreamError(
            f"without rolling, tokens sit at their stream positions and the model has {self.context} positions: "
            f"{self.context} tokens fit in all and {left} more fit in this cache ({self.seen} fed so far), not "
            f"{tokens}. Keep rolling on (the default) if the model uses RoPE, or feed a shorter stream")

    def begin_forward(self, inputs: torch.Tensor, *, model=None, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids for the forward about to run and the banded mask chunked mode needs (or None).

        `inputs` (batch, length[, hidden]) are its token ids or embeddings, `model` the base model running it, and
        `position_ids` / `attention_mask` what its caller passed (the cache replaces both). The forward is checked
        first, so that misuse is one clear H2OStreamError before the model runs, with the cache untouched, instead
        of a reshape error or silently wrong numbers.
        """
        batch, length = inputs.shape[:2]
        self._check_model(model)
        self._check_batch(batch)
        _check_attention_mask(attention_mask)
        self._check_positions(position_ids, length)
        if self.slots:  # a prompt into an empty cache may be wider (model.generate prefills it in one forward)
            self.check_chunk_size(length)
        self.check_fits(length)
        if self.policy.needs_tokens:
            self._pass_tokens(inputs)
        start = self.slots if self.rolling else self.seen
        if self.rolling and self.context is not None and start + length > self.context:
            raise H2OStreamError(
                f"a chunk of {length} tokens on top of {start} cached entries needs positions up to "
                f"{start + length - 1}, beyond the model's context of {self.context}; use a smaller chunk or cache")
        positions = torch.arange(start, start + length, device=inputs.device).unsqueeze(0)
        return positions, self.band_mask(length, inputs.device)

    def _pass_tokens(self, inputs: torch.Tensor) -> None:
        """Hand the forward's token ids to every layer (for a policy that reads them); embeddings are refused."""
        if inputs.dim() != 2 or inputs.is_floating_point():
            raise H2OStreamError(f"{self.policy.describe()} reads the token id of every entry: call the model with "
                                 "input_ids, not inputs_embeds")
        for layer in self.layers:
            layer.pending_tokens = inputs

    def _check_model(self, model) -> None:
        if model is None or model is self._model():
            return
        config = model.config.get_text_config(decoder=True)
        theirs = _model_shape(config)
        differs = "" if theirs == self._model_shape else f"; that one has {_describe(theirs)}"
        raise H2OStreamError(f"this StreamingCache was made for another model ({_describe(self._model_shape)})"
                             f"{differs}: make a new StreamingCache for each model")

    def _check_batch(self, batch: int) -> None:
        held = self.layers[0].positions
        if held is not None and held.shape[0] != batch:
            raise H2OStreamError(f"this cache holds {held.shape[0]} stream(s) and the forward brings a batch of "
                                 f"{batch}: reset() the cache (or make a new one) before changing the batch size")

    def _check_positions(self, position_ids: torch.Tensor | None, length: int) -> None:
        """The forward must bring tokens, and a caller's position ids must continue the stream the cache holds.

        model.generate slices its input by the tokens the cache has seen and passes position ids; given a prompt the
        cache already holds, it feeds a tail of it (or nothing) at positions the cache is long past.
        """
        if length and (position_ids is None or _continues(position_ids, self.seen, length)):
            return
        if length and position_ids.numel():
            first, last = position_ids.min().item(), position_ids.max().item()
            given = f"the forward's position ids ({first}..{last}) do not continue"
        else:
            given = "the forward brings no tokens to continue"
        raise H2OStreamError(
            f"{given} the stream this cache holds ({self.seen} tokens seen, so the next is at {self.seen}). "
            f"model.generate does this when given a prompt the cache already holds: pass the whole sequence so far, "
            f"or reset() the cache or make a new one")

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' `Cache.update`, only from a forward h2o-stream has set up (see `attach`)."""
        if active_cache() is not self:
            raise H2OStreamError(
                "this StreamingCache is being filled by a forward that h2o-stream did not set up: a model the cache "
                "was not made for (make a new StreamingCache for each model) or one used inside another forward")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

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
