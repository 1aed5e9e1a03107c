"""A fixed-budget KV cache that plugs into transformers as a `Cache`.

Per layer and KV head it holds at most `policy.budget` entries between forward passes (one more while a fair chunk's
last cut waits for the next forward: `settle`). A forward of C tokens appends their keys/values (slots n..n+C-1),
the attention function attends over all n+C entries and reports how much attention each entry received, and the
layer then cuts back to the budget with the policy's choice of slots.

Chunked mode is fair by default: no query sees more than budget + 1 keys, as in exact (token-by-token) mode. Band
policies (sink, window) get exactly exact mode's keys through a banded mask; every other policy first cuts the cache
to budget + 1 - C entries with its own choice at that smaller budget (`EvictionPolicy.reduced`), so that the chunk's
last query sees budget + 1. `wide_chunks=True` skips that cut (queries then see up to budget + C keys).

With `decide_every=k`, a forward wider than k tokens is scanned: the model's projections and MLPs run over the whole
forward at once, and inside each layer the attention function takes the forward k tokens at a time (blocks at
multiples of k of the tokens the cache has seen), appending, attending, scoring and cutting per block exactly as
separate forwards of those blocks would. Results equal feeding the blocks one forward each (up to float rounding of
the wider matrix products); `decide_every=1` is exact mode. The position of every token is known before the forward
runs, because how many entries each block finds depends only on the block sizes.

The per-layer storage and its invariants are in `layer.py`.
"""

from __future__ import annotations

import math
import weakref

import torch
from transformers.cache_utils import Cache

from ..errors import H2OStreamError
from ..rope_rolling import RopeRoller
from .hooks import active_cache, attach
from .layer import StreamingLayer, compiled_loop
from .memo import memoised
from .policies import EvictionPolicy


#: the chunk size for policies whose chunked mode equals exact mode at any chunk (band policies, the full cache)
BAND_CHUNK = 256


def default_chunk_size(policy: EvictionPolicy) -> int:
    """Tokens per forward when a user gives none: 256 for band policies and the full cache (their chunked mode is
    exact mode at any chunk size). For the others, whose fair chunks cut to budget + 1 - C entries first: the
    policy's `fair_chunk_share` of the budget (a sixteenth unless it says otherwise), and no more than the largest
    power of two up to its recent window + 1.

    Early queries of a chunk see up to C - 1 keys fewer than exact mode and decisions are taken once per chunk, so C
    stays small against the budget (a quarter of the cache put tova and sepllm well off their exact-mode PPL). And a
    chunk shields its own tokens from every cut until it ends, where exact mode shields only the recent window: a
    chunk up to the window + 1 wide holds no token exact mode could already have cut. Wider, it flatters policies
    with a small window (roco, window 10) and most of all tova, which has none and drifts further below exact mode
    the longer the stream: tova's default is exact mode. Measured in eval/results/quality/. A share of 0 makes exact
    mode the default (roco: its compiled exact mode runs faster than its chunks of 8 did, eval/results/speed/)."""
    if policy.budget is None or policy.band() is not None:
        return BAND_CHUNK
    shielded = 1 << (policy.split().get("recent", 0) + 1).bit_length() - 1  # largest power of two <= recent + 1
    return max(1, min(math.floor(policy.budget * policy.fair_chunk_share), shielded))


@memoised(16)
def _band_mask(sinks: int, recent: int, n: int, length: int, device: torch.device) -> torch.Tensor:
    """`StreamingCache.band_mask`, memoised: in steady state every forward has the same shape, so the attention's
    derived masks (`band_bias`) are memoised too. Never modify the result."""
    query_slot = torch.arange(n, n + length, device=device).unsqueeze(-1)
    key_slot = torch.arange(n + length, device=device)
    visible = (key_slot <= query_slot) & ((key_slot < sinks) | (key_slot >= query_slot - recent))
    return visible[None, None]


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


class StreamingCache(Cache):
    """Fixed-budget cache for `model`: pass it as `cache=` to a forward or to `model.generate`.

    Construction attaches h2o-stream to the model (attention function + two hooks, once per model); the cache then
    owns position ids: with rolling they are slot indices, without rolling true stream positions. It serves that one
    model and one batch of unpadded streams; anything else is refused before the model runs (see `begin_forward`).
    """

    def __init__(self, model, policy: EvictionPolicy, *, rolling: bool = True, wide_chunks: bool = False,
                 decide_every: int | None = None):
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
        # fair chunks (the default) cut before a chunk so that no query sees more than budget + 1 keys
        self.fair = not wide_chunks and policy.band() is None and budget is not None
        self.context = context
        if decide_every is not None and decide_every < 1:
            raise H2OStreamError(f"decide_every must be at least 1 token, got {decide_every}")
        self.decide_every = None
        if decide_every is not None and policy.band() is None and budget is not None:
            # only policies that decide once per forward need the scan: band policies are exact at any width
            self.check_chunk_size(decide_every)  # a decision may not take more than an unscanned forward may
            self.decide_every = decide_every
        attach(model)
        # The model it was made for (its rotary tables and shapes are baked in); weak, so the cache never keeps it.
        self._model = weakref.ref(model.base_model)
        self._model_shape = _model_shape(config)

    @property
    def slots(self) -> int:
        """Entries per KV head now held (the same in every layer), at most the budget (after `settle`)."""
        self.settle()
        return self._held

    @property
    def _held(self) -> int:
        # what the layers hold, a pending cut (layer.py) not made: the engine plans forwards with this
        return self.layers[0].slots

    def settle(self) -> None:
        """Make the cut a fair chunk may have left to the next forward (one entry per layer and KV head over the
        budget, for a policy whose cuts nest: see `StreamingLayer.after_attention`), so that the layers hold at most
        the budget. The same entries stay as if it had been made at once; `slots`, `evicted` and `state` call it."""
        for layer in self.layers:
            layer.settle()

    @property
    def seen(self) -> int:
        return self.layers[0].seen

    @property
    def evicted(self) -> int:
        self.settle()
        return sum(layer.evicted for layer in self.layers)

    @property
    def max_keys_seen(self) -> int:
        """The most keys any query has attended to (budget + 1 at most, in exact mode and in fair chunked mode, once
        the cache holds entries; a prompt into an empty cache sees itself)."""
        return max(layer.max_keys for layer in self.layers)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        # The mask is built in slot space: queries sit right after the n cached entries.
        return self.layers[layer_idx].slots

    @property
    def max_chunk(self) -> int | None:
        """The most tokens one forward may add on top of cached entries (None: no limit from the policy).

        A policy without a band (h2o and every other policy that decides once per chunk) makes room for a fair chunk
        by cutting to budget + 1 - C entries first, which needs C <= budget; with `wide_chunks` every query of a chunk
        sees the n cached entries and its chunk predecessors, and a chunk wider than the budget would make that far
        more than the budget + 1 keys exact mode gives a query (a 1-entry h2o cache would beat every other policy).
        Band policies (sink, window) mask each query down to exactly what exact mode gives it, so they take any
        chunk.

        A scanned cache (`decide_every`) takes forwards of any width: it decides every `decide_every` tokens inside
        them, so no decision covers more than that.
        """
        return None if self.policy.band() is not None or self.decide_every is not None else self.policy.budget

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

    def check_forward(self, inputs: torch.Tensor, *, model=None, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> tuple[list[int] | None, int, list[int] | None]:
        """Refuse (H2OStreamError) a forward this cache cannot take, changing nothing; `begin_forward`'s arguments.
        Returns its plan for `start_forward`: (its scan blocks, its first position, every token's slot or None).

        Misuse is one clear error before the model runs, with the cache untouched, instead of a reshape error or
        silently wrong numbers."""
        batch, length = inputs.shape[:2]
        self._check_model(model)
        self._check_batch(batch)
        _check_attention_mask(attention_mask)
        self._check_positions(position_ids, length)
        blocks = self.blocks(length)
        if self._held and blocks is None:  # a prompt into an empty cache may be wider (generate prefills it at once)
            self.check_chunk_size(length)
        self.check_fits(length)
        if self.policy.needs_tokens and (inputs.dim() != 2 or inputs.is_floating_point()):
            raise H2OStreamError(f"{self.policy.describe()} reads the token id of every entry: call the model with "
                                 "input_ids, not inputs_embeds")
        start, slots = self._slots_of(length, blocks)
        last = start + length - 1 if slots is None else slots[-1]
        if self.rolling and self.context is not None and last >= self.context:
            raise H2OStreamError(
                f"a chunk of {length} tokens on top of {start} cached entries needs positions up to "
                f"{last}, beyond the model's context of {self.context}; use a smaller chunk or cache")
        return blocks, start, slots

    def begin_forward(self, inputs: torch.Tensor, *, model=None, position_ids: torch.Tensor | None = None,
                      attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids for the forward about to run and the banded mask chunked mode needs (or None).

        `inputs` (batch, length[, hidden]) are its token ids or embeddings, `model` the base model running it, and
        `position_ids` / `attention_mask` what its caller passed (the cache replaces both). The forward is checked
        first (`check_forward`).
        """
        plan = self.check_forward(inputs, model=model, position_ids=position_ids, attention_mask=attention_mask)
        return self.start_forward(inputs, plan)

    def start_forward(self, inputs: torch.Tensor, plan: tuple[list[int] | None, int, list[int] | None]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`begin_forward` after its checks: set the layers up for the forward `check_forward` planned."""
        length = inputs.shape[1]
        blocks, start, slots = plan
        if self.policy.needs_tokens:
            for layer in self.layers:
                layer.pending_tokens = inputs
        compiled = self._compiles(length, blocks)
        if compiled:
            blocks = blocks or [1]  # a one-token forward is a scan of one block (the same steps)
        if self.fair and self._held and blocks is None:
            for layer in self.layers:
                layer.make_room(length)
        for layer in self.layers:
            layer.scan, layer.scan_fair, layer.compiled = blocks, self.fair, compiled
        if slots is None:
            positions = torch.arange(start, start + length, device=inputs.device).unsqueeze(0)
        else:
            positions = torch.tensor(slots, device=inputs.device).unsqueeze(0)
        return positions, self.band_mask(length, inputs.device)

    def _compiles(self, length: int, blocks: list[int] | None) -> bool:
        """Whether a forward is exact mode's steps for the compiled loop (engine/compiled.py): one token, or a scan in
        blocks of one, with gradients off, for a policy that declares its one-entry cut (`drop_one`). Its attention
        may still decline (device, dtype: `StreamingLayer.compiles`) and take the blocks one by one."""
        one_token_steps = blocks is None and length == 1 or blocks is not None and max(blocks) == 1
        return (one_token_steps and self.layers[0].drop_rule is not None and not torch.is_grad_enabled()
                and compiled_loop() is not None)

    def _slots_of(self, length: int, blocks: list[int] | None) -> tuple[int, list[int] | None]:
        """(the first token's position, every token's slot in a scanned forward with rolling, else None) for a
        forward of `length` tokens, before it runs: with rolling a fair chunk first cuts to budget + 1 - length."""
        if not self.rolling:
            return self.seen, None
        if blocks is not None:
            slots = self._block_slots(blocks)
            return slots[0], slots
        n = self._held
        if self.fair and n:
            n = min(n, self.policy.budget + 1 - length)
        return n, None

    def blocks(self, length: int) -> list[int] | None:
        """The block sizes a forward of `length` tokens is scanned in (see the module docstring), or None when it is
        one decision: blocks end at multiples of `decide_every` of the tokens seen, and at the forward's end."""
        step = self.decide_every
        if step is None or length <= 1:
            return None
        sizes, done = [], 0
        while done < length:
            sizes.append(min(step - (self.seen + done) % step, length - done))
            done += sizes[-1]
        return sizes if len(sizes) > 1 else None

    def _block_slots(self, blocks: list[int]) -> list[int]:
        """With rolling: the slot of every token of a scanned forward. Each block finds n entries (after the fair
        cut to budget + 1 - C, if any), takes slots n..n+C-1, and its cut leaves min(n + C, budget)."""
        budget, n, slots = self.policy.budget, self._held, []
        for size in blocks:
            if self.fair and n:
                n = min(n, budget + 1 - size)
            slots.extend(range(n, n + size))
            n = min(n + size, budget)
        return slots

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
        return _band_mask(*band, self._held, length, device)

    def state(self) -> dict:
        """A snapshot of every layer (after any pending cut), for `load_state`."""
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
