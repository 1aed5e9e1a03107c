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
from .attention import causal_mask
from .checks import (
    _check_attention_mask,
    _check_batch,
    _check_chunk,
    _check_context,
    _check_positions,
    _check_same_model,
    _check_slots,
    _check_stream_fits,
    _check_token_ids,
    _model_shape,
    model_signature,
)
from .hooks import active_cache, attach
from .layer import StreamingLayer, compiled_loop
from .layer_types import layer_policies, layer_windows, token_slots
from .plan import ForwardPlan, LayerPlan, Slots
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


class StreamingCache(Cache):
    """Fixed-budget cache for `model`: pass it as `cache=` to a forward or to `model.generate`.

    Construction attaches h2o-stream to the model (attention function + two hooks, once per model); the cache then
    owns position ids: with rolling they are slot indices, without rolling true stream positions. It serves that one
    model and one batch of unpadded streams; anything else is refused before the model runs (see `begin_forward`).
    """

    # every layer is a StreamingLayer; transformers' Cache declares the list of its own layer types (list is invariant)
    layers: list[StreamingLayer]  # type: ignore[assignment]

    def __init__(
        self,
        model,
        policy: EvictionPolicy,
        *,
        rolling: bool = True,
        wide_chunks: bool = False,
        decide_every: int | None = None,
        sliding: str = "window",
    ):
        config = model.config.get_text_config(decoder=True)
        rollers = RopeRoller.for_layers(model) if rolling else [None] * config.num_hidden_layers
        # Each layer's own policy (layer_types.py): sliding-window layers keep their window by default, and a policy
        # with a per-layer schedule (pyramid) its own budget in every global layer.
        windows = self._windows = layer_windows(config)
        self._slides = any(window is not None for window in windows)  # checkpoints record the sliding mode then
        policies = layer_policies(policy, windows, sliding)
        policy.fit_model(
            [i for i, p in enumerate(policies) if type(p) is type(policy)],
            _model_shape(config)[1],
            model_signature(config),
        )
        budget = max((p.budget for p in policies if p.budget is not None), default=None)
        context = getattr(config, "max_position_embeddings", None)
        _check_context(policy, budget, context, rolling)
        super().__init__(
            layers=[StreamingLayer(p, r, i) for i, (p, r) in enumerate(zip(policies, rollers, strict=True))]
        )
        self.policy = policy
        self.sliding = sliding
        self.rolling = rolling
        # The lead layer sets the positions the model is given: the first running the chosen policy, or its first
        # global layer where each runs its own budget (the layers that run another one, sliding windows, are moved to
        # their own slots inside the forward).
        self._lead = next(
            (i for i, p in enumerate(policies) if p is policy),
            next((i for i, window in enumerate(windows) if window is None), 0),
        )
        lead = policies[self._lead]
        # fair chunks (the default) cut before a chunk so that no query sees more than budget + 1 keys
        self._fair = [not wide_chunks and p.band() is None and p.budget is not None for p in policies]
        self.fair = self._fair[self._lead]
        self.context = context
        if decide_every is not None and decide_every < 1:
            raise H2OStreamError(f"decide_every must be at least 1 token, got {decide_every}")
        self.decide_every = None
        if decide_every is not None and lead.band() is None and lead.budget is not None:
            # only policies that decide once per forward need the scan: band policies are exact at any width
            self.check_chunk_size(decide_every)  # a decision may not take more than an unscanned forward may
            self.decide_every = decide_every
        attach(model)
        # The model it was made for (its rotary tables and shapes are baked in); weak, so the cache never keeps it.
        self._model = weakref.ref(model.base_model)
        self._model_shape = _model_shape(config)

    @property
    def layer_policies(self) -> list[EvictionPolicy]:
        """The policy each layer runs (the chosen one, or a sliding layer's window: layer_types.py)."""
        return [layer.policy for layer in self.layers]

    @property
    def entries(self) -> int:
        """Entries per KV head held now, summed over all layers (after `settle`): what the cache's memory is, with
        sliding layers holding their window and global layers the budget."""
        self.settle()
        return sum(layer.slots for layer in self.layers)

    @property
    def slots(self) -> int:
        """Entries per KV head now held by the layers that run the chosen policy, at most the budget (after
        `settle`); with a per-layer schedule (pyramid) the mean over those layers, rounded down; layers that run
        another policy (sliding windows) hold their own number (`entries` sums them all)."""
        self.settle()
        if self.policy.layer_schedule is None:
            return self._held
        held = [layer.slots for layer, window in zip(self.layers, self._windows, strict=True) if window is None]
        return sum(held) // len(held)

    @property
    def _held(self) -> int:
        # what the lead layer holds, a pending cut (layer.py) not made: the engine plans forwards with this
        return self.layers[self._lead].slots

    def settle(self) -> None:
        """Make the cut a fair chunk may have left to the next forward (one entry per layer and KV head over the
        budget, for a policy whose cuts nest: see `StreamingLayer.after_attention`), so that the layers hold at most
        the budget. The same entries stay as if it had been made at once; `slots`, `evicted` and `state` call it."""
        for layer in self.layers:
            layer.settle()

    @property
    def seen(self) -> int:
        return self.layers[self._lead].seen

    @property
    def evicted(self) -> int:
        self.settle()
        return sum(layer.evicted for layer in self.layers)

    @property
    def max_keys_seen(self) -> int:
        """The most keys any query has attended to (budget + 1 at most, in exact mode and in fair chunked mode, once
        the cache holds entries; a prompt into an empty cache sees itself)."""
        return max(layer.max_keys for layer in self.layers)

    def get_query_offset(self, layer_idx: int | None = None) -> int:
        # The mask is built in slot space: queries sit right after the n cached entries.
        return self.layers[self._lead if layer_idx is None else layer_idx].slots

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
        bounded = [
            p.budget
            for p, fair in zip(self.layer_policies, self._fair, strict=True)
            if p.band() is None and p.budget is not None
        ]
        return None if not bounded or self.decide_every is not None else min(bounded)

    def check_chunk_size(self, chunk_size: int) -> None:
        """Refuse (H2OStreamError) a chunk size wider than `max_chunk`; apps call it up front, before any work."""
        _check_chunk(chunk_size, self.max_chunk, self.policy)

    def check_fits(self, tokens: int) -> None:
        """Refuse (H2OStreamError) `tokens` more stream tokens whose positions would pass the model's context.

        Only without rolling: tokens then sit at their true stream positions, so a stream can outrun the model's
        position table (an IndexError deep in the model otherwise). begin_forward checks every forward; an app may
        call this up front with the length of a whole stream.
        """
        _check_stream_fits(tokens, rolling=self.rolling, context=self.context, seen=self.seen)

    def check_forward(
        self,
        inputs: torch.Tensor,
        *,
        model=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> ForwardPlan:
        """Refuse (H2OStreamError) a forward this cache cannot take, changing nothing; `begin_forward`'s arguments.
        Returns its plan for `start_forward` (engine/plan.py): the positions the model gets, each layer's part.

        Misuse is one clear error before the model runs, with the cache untouched, instead of a reshape error or
        silently wrong numbers."""
        batch, length = inputs.shape[:2]
        self._check_model(model)
        _check_batch(self.layers[0].positions, batch)
        _check_attention_mask(attention_mask)
        _check_positions(position_ids, self.seen, length)
        blocks = self.blocks(length)
        if self._held and blocks is None:  # a prompt into an empty cache may be wider (generate prefills it at once)
            self.check_chunk_size(length)
        self.check_fits(length)
        _check_token_ids(self.policy, inputs)
        start, slots = self._slots_of(length, blocks)
        _check_slots(start, slots, length, rolling=self.rolling, context=self.context)
        given = range(start, start + length) if slots is None else tuple(slots)  # the positions the model gets
        return ForwardPlan(given, self._layer_plans(inputs, blocks, given))

    def begin_forward(
        self,
        inputs: torch.Tensor,
        *,
        model=None,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Position ids for the forward about to run and the banded mask chunked mode needs (or None).

        `inputs` (batch, length[, hidden]) are its token ids or embeddings, `model` the base model running it, and
        `position_ids` / `attention_mask` what its caller passed (the cache replaces both). The forward is checked
        first (`check_forward`).
        """
        plan = self.check_forward(inputs, model=model, position_ids=position_ids, attention_mask=attention_mask)
        return self.start_forward(inputs, plan)

    def start_forward(self, inputs: torch.Tensor, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`begin_forward` after its checks: hand each layer its part of the forward `check_forward` planned
        (`StreamingLayer.begin`). Returns the position ids and the mask to give transformers (each layer makes its
        own mask; see hooks.py)."""
        for layer, layer_plan in zip(self.layers, plan.layers, strict=True):
            layer.begin(layer_plan)
        positions = torch.tensor(plan.positions, device=inputs.device).unsqueeze(0)
        return positions, self.transformers_mask(inputs.shape[1], inputs.device)

    def _layer_plans(self, inputs: torch.Tensor, blocks: list[int] | None, given: Slots) -> tuple[LayerPlan, ...]:
        """Each layer's part of a forward of `inputs` scanned in `blocks` (or None), the model given the positions
        `given`: its blocks (a band policy decides once, unless it takes exact mode's compiled steps), whether it is
        fair, compiled, and moved to its own slots (a rolling layer whose policy is not the lead layer's)."""
        length = inputs.shape[1]
        one_token_steps = self._compiles(length, blocks)
        own: dict[int, Slots] = {}  # slots of the tokens, per layer policy
        plans = []
        for i, layer in enumerate(self.layers):
            policy = layer.policy
            compiled = one_token_steps and layer.drop_rule is not None
            layer_blocks = blocks if policy.band() is None or (compiled and blocks) else None
            if compiled:
                layer_blocks = layer_blocks or [1] * length  # one-token steps: a scan of one-token blocks
            moved = None
            if self.rolling and layer.roller is not None and policy is not self._lead_policy:
                if id(policy) not in own:  # where the tokens go after the fair cut `begin` makes first
                    own[id(policy)] = token_slots(policy.budget, layer.slots, self._fair[i], length, layer_blocks)
                if own[id(policy)] != given:
                    moved = (given, own[id(policy)])
            plans.append(
                LayerPlan(
                    length,
                    None if layer_blocks is None else tuple(layer_blocks),
                    fair=self._fair[i],
                    compiled=compiled,
                    moved=moved,
                    tokens=inputs if policy.needs_tokens else None,
                )
            )
        return tuple(plans)

    @property
    def _lead_policy(self) -> EvictionPolicy:
        return self.layers[self._lead].policy

    def _compiles(self, length: int, blocks: list[int] | None) -> bool:
        """Whether a forward is exact mode's steps for the compiled loop (engine/compiled.py): one token, or a scan in
        blocks of one, with gradients off; a layer takes it if its policy declares its one-entry cut (`drop_one`).
        Its attention may still decline (device, dtype: `StreamingLayer.compiles`) and take the blocks one by one."""
        one_token_steps = blocks is None and length == 1 or blocks is not None and max(blocks) == 1
        return one_token_steps and not torch.is_grad_enabled() and compiled_loop() is not None

    def _slots_of(self, length: int, blocks: list[int] | None) -> tuple[int, list[int] | None]:
        """(the first token's position, every token's slot in a scanned forward with rolling, else None) for a
        forward of `length` tokens, before it runs: the lead layer's slots (with rolling a fair chunk first cuts to
        budget + 1 - length; layer_types.token_slots)."""
        if not self.rolling:
            return self.seen, None
        slots = token_slots(self._lead_policy.budget, self._held, self.fair, length, blocks)
        if blocks is not None:
            return slots[0], list(slots)
        assert isinstance(slots, range)  # an unscanned forward's slots are one range (token_slots)
        return slots.start, None

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

    def _check_model(self, model) -> None:
        """Refuse a forward of `model` (the base model, or None) if this cache was made for another (rows.py too)."""
        _check_same_model(model, self._model(), self._model_shape)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """transformers' `Cache.update`, only from a forward h2o-stream has set up (see `attach`)."""
        if active_cache() is not self:
            raise H2OStreamError(
                "this StreamingCache is being filled by a forward that h2o-stream did not set up: a model the cache "
                "was not made for (make a new StreamingCache for each model) or one used inside another forward"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def transformers_mask(self, length: int, device) -> torch.Tensor | None:
        """The 4D mask handed to transformers in place of the one it would build (None: let it build its own). Every
        layer attends with its own mask (`StreamingLayer.mask`); a 4D mask only keeps transformers from building
        masks of its own, which for sliding-window layers it would size from positions the cache has renumbered.
        The lead layer's: its band for sink/window chunks, else (with layers of several kinds) causal."""
        lead = self.layers[self._lead]
        mask = lead.mask(length, self._held, device)
        if mask is None and length > 1 and len({id(p) for p in self.layer_policies}) > 1:
            mask = causal_mask(length, self._held + length, device)
        return mask

    def state(self) -> dict:
        """A snapshot of every layer (after any pending cut), for `load_state`."""
        state = {
            "policy": self.policy.settings(),
            "rolling": self.rolling,
            "layers": [layer.state() for layer in self.layers],
        }
        if self._slides:
            state["sliding"] = self.sliding
        return state

    def load_state(self, state: dict) -> None:
        if state["policy"] != self.policy.settings() or state["rolling"] != self.rolling:
            raise H2OStreamError(
                f"saved cache was made with {state['policy']} (rolling={state['rolling']}), "
                f"not {self.policy.settings()} (rolling={self.rolling})"
            )
        mine = self.sliding if self._slides else None
        if state.get("sliding") != mine:
            raise H2OStreamError(f"saved cache was made with sliding layers {state.get('sliding')!r}, not {mine!r}")
        if len(state["layers"]) != len(self.layers):
            raise H2OStreamError(f"saved cache has {len(state['layers'])} layers, this model {len(self.layers)}")
        for layer, layer_state in zip(self.layers, state["layers"], strict=True):
            layer.load_state(layer_state)
