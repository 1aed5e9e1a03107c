"""One layer of a `StreamingCache`: its entries (keys, values, stream positions, scores, token ids) and the cuts.

Invariants:
- keys/values/positions (and scores and tokens, for a policy that uses them) share the slot axis; slots are in ascending
  stream order for every head;
- with rolling, `keys` are un-rotated and every head has the same n, so slot j is used at position j;
- without rolling, `keys` stay as the model rotated them, at their true stream positions;
- during a scanned forward (the plan's `blocks` set), `update` appends nothing: `open_block` appends the forward's new
  entries one block at a time, each block after the previous one's cut, exactly as if each block were its own forward;
- between forwards a layer holds at most budget entries, or budget + 1 with `cut_pending`: a fair chunk leaves its
  cut of that one entry to the cut before the next chunk (`make_room`), which then cuts once to where both would end
  (a policy whose cuts nest: one cut with the reduced policy; any other: `keep_twice`); `settle` makes the pending cut
  now (the cache does, before anyone reads it);
- after `make_room`, the per-slot tensors view the first rows of tensors as many slots longer as the chunk (`_room`),
  which the chunk's append fills in place of concatenating; anything else that replaces them leaves the room unused.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..rope_rolling import RopeRoller
from .attention import band_mask, causal_mask
from .memo import ordinary, outside_inference_mode
from .plan import LayerPlan
from .policies import EvictionPolicy, score_updates
from .switch import compiled_part


class StreamingLayer(CacheLayerMixin):
    """One model layer's entries, and its part of the forward now running (`plan`, a `LayerPlan` the cache made).

    The calls of a forward, in order:
    1. `begin(plan)` (the cache's `start_forward`, before the model runs): a fair chunk decided once makes room;
    2. `update(keys, values)` (transformers, in the layer's attention): moves the keys to the layer's own slots
       (`plan.moved`) and appends them, or in a scan returns them for the blocks;
    3. the attention function (hooks.py), with what `update` returned: `move_query`, then either `mask` and one
       attention, then `after_attention`; or, in a scan, per block `open_block` and `after_attention` (with
       `more_blocks` until the last); or, for exact mode's one-token steps, `compiles` and then `compiled_steps`.
    Between forwards: `settle`, `state`, `load_state`, `reset`.
    """

    is_sliding = False
    is_croppable = False

    def __init__(self, policy: EvictionPolicy, roller: RopeRoller | None, index: int = 0):
        super().__init__()
        self.policy = policy
        self.roller = roller
        self.index = index  # the model layer it serves (seeded draws differ per layer: engine/draws.py)
        self.positions: torch.Tensor | None = None  # (batch, kv_heads, n) stream index of each slot
        self.scores: torch.Tensor | None = None  # (batch, kv_heads, n[, 2]) attention scores, if the policy uses them
        self.tokens: torch.Tensor | None = None  # (batch, kv_heads, n) token ids, if the policy reads them
        self.plan = LayerPlan(0)  # the forward now running (or last run); set by `begin` only
        self.seen = 0  # tokens this layer has been given
        self.evicted = 0  # entries cut, summed over heads
        self.max_keys = 0  # the most keys any query of this layer has seen
        self._rows_memo: dict[tuple[int, int, int], torch.Tensor] = {}
        self._offsets_memo: dict[tuple[int, int, int], torch.Tensor] = {}
        self._reduced: dict[int, EvictionPolicy] = {}  # the policy at smaller budgets, for fair chunks
        self._workspace = None  # the compiled loop's storage (engine/compiled.py); the layer's tensors view it
        self.drop_rule = policy.drop_one()  # how exact mode's one-entry cut is made, if the loop can make it
        # what a fair chunk's cut left room in (`make_room`): the per-slot tensors with `length` rows more, the layer's
        # own tensors viewing their first rows, for the chunk's append to fill in place instead of concatenating
        self._room: list[torch.Tensor | None] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, _ = key_states.shape
        self.device = key_states.device
        self.keys = key_states[..., :0, :].clone()
        self.values = value_states[..., :0, :].clone()
        self.positions = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)
        if self.policy.needs_scores:  # a policy without them carries none (no tensor to grow and cut every step)
            self.scores = torch.empty(
                batch, heads, 0, *self.policy.score_moments, dtype=self._score_dtype, device=self.device
            )
        if self.policy.needs_tokens:
            self.tokens = torch.empty(batch, heads, 0, dtype=torch.long, device=self.device)
        self.is_initialized = True

    @property
    def slots(self) -> int:
        return 0 if self.keys is None else self.keys.shape[-2]

    def _entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The keys, values and positions of a layer that holds entries (initialized)."""
        assert self.keys is not None and self.values is not None and self.positions is not None, "not initialized"
        return self.keys, self.values, self.positions

    def begin(self, plan: LayerPlan) -> None:
        """Take the plan of the forward about to run (the first call of a forward: see the class docstring); a fair
        chunk decided once first makes room for its tokens (a scan makes room block by block: `open_block`)."""
        if plan.fair and self.slots and plan.blocks is None:
            self.make_room(plan.length)
        self.plan = plan

    def update(self, key_states, value_states, *args, **kwargs):
        """Append C new entries (rotated by the model at slots n..n+C-1) and return what attention should use.

        In a scanned forward nothing is appended here: it returns the forward's keys (at the layer's own slots) and
        values, which the attention function appends block by block (`open_block`)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.plan.moved is not None:
            key_states = self._move(key_states)
        if self.plan.blocks is not None:
            return key_states, value_states
        return self._append(key_states, value_states, self.plan.tokens)

    def move_query(self, query: torch.Tensor) -> torch.Tensor:
        """The forward's queries at this layer's own slots (the plan's `moved`), from where the model rotated them."""
        return query if self.plan.moved is None else self._move(query)

    def _move(self, x: torch.Tensor) -> torch.Tensor:
        moved = self.plan.moved
        assert self.roller is not None and moved is not None  # the cache moves only a rolling layer (`moved`)
        return self.roller.move(x, *moved)

    def mask(self, length: int, held: int, device) -> torch.Tensor | None:
        """The mask of a forward of `length` queries over `held` entries and themselves, bool, True = attend, or None
        for one query: a band policy's band (exact mode's keys for every query), else causal."""
        if length == 1:
            return None
        band = self.policy.band()
        return causal_mask(length, held + length, device) if band is None else band_mask(*band, held, length, device)

    def open_block(
        self, keys: torch.Tensor, values: torch.Tensor, start: int, length: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """In a scanned forward whose keys and values `update` returned: make room for the block of `length` entries
        at `start` of the forward (fair chunks), append it and return the keys and values its queries attend to."""
        if self.plan.fair and self.slots:
            self.make_room(length)
        tokens = None if self.plan.tokens is None else self.plan.tokens[:, start : start + length]
        block = slice(start, start + length)
        return self._append(keys[..., block, :], values[..., block, :], tokens)

    def compiles(self, query: torch.Tensor) -> bool:
        """Whether the scanned forward now running goes through the compiled loop (`compiled_steps`): its blocks are
        one token each (the plan's `compiled`) and its attention fits the loop (CPU, float32/float64, a rotation of
        halves; the attention function checks the model's extras: soft-capping, sink logits)."""
        return (
            self.plan.compiled
            and query.device.type == "cpu"
            and query.dtype in (torch.float32, torch.float64)
            and (self.roller is None or not self.roller.pairs)
        )

    def compiled_steps(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """The scanned forward's one-token blocks (its keys and values as `update` returned them) in one compiled
        call (engine/compiled.py): the same appends, attention, scores and cuts as taking them block by block.
        Returns the attention output (batch, L, q_heads, dim)."""
        compiled = compiled_loop()
        self.settle()  # a fair chunk's pending cut: what the first block's make_room(1) would do
        budget = self.policy.budget
        assert budget is not None  # the loop runs a policy with a `drop_one`, which a bounded one has
        space = self._workspace
        if space is None or not space.holds(self.keys):
            space = self._workspace = compiled.Workspace.around(
                self.keys, self.values, self.positions, self.scores, budget + 1, self.policy.score_moments
            )
        tables = None
        if self.roller is not None:
            table = self.roller.table(budget + 1, self.device)
            tables = (table["cos"], table["sin_rh"], table["ucos"], table["usin_rh"])
        output, held, dropped, most = compiled.exact_steps(
            space,
            self.slots,
            query,
            keys,
            values,
            tables,
            scaling=scaling,
            seen=self.seen,
            budget=budget,
            rule=self.drop_rule,
            layer_mean=self.policy.score_heads == "layer",
        )
        self.keys, self.values, self.positions, self.scores = space.hand_out(held, self.scores is not None)
        self.seen += keys.shape[-2]
        self.evicted += dropped
        self.max_keys = max(self.max_keys, most)
        return output

    def _append(self, key_states, value_states, tokens):
        n, c = self.slots, key_states.shape[-2]
        if self.roller is not None:
            key_states = self.roller.unrotate(key_states, n, n + c)
        batch, heads = self.positions.shape[:2]
        if c == 1:  # exact mode: one operation instead of two
            new_positions = self.positions.new_full((batch, heads, 1), self.seen)
        else:
            new_positions = torch.arange(self.seen, self.seen + c, device=self.device).expand(batch, heads, c)
        new_tokens = None if self.tokens is None else tokens.to(self.device).unsqueeze(1).expand(batch, heads, c)
        room, self._room = self._room, None
        if room is not None and self._fills(room, n + c):
            for full, new in zip(room, (key_states, value_states, new_positions, None, new_tokens), strict=True):
                if full is None:
                    continue
                if new is None:  # the scores: new entries' start at 0
                    full.narrow(2, n, c).zero_()
                else:
                    full.narrow(2, n, c).copy_(new)
            self.keys, self.values, self.positions, self.scores, self.tokens = room
        else:
            self.keys = torch.cat([self.keys, key_states], dim=-2)
            self.values = torch.cat([self.values, value_states], dim=-2)
            self.positions = torch.cat([self.positions, new_positions], dim=-1)
            if self.scores is not None:
                new_scores = self.scores.new_zeros(batch, heads, c, *self.scores.shape[3:])
                self.scores = torch.cat([self.scores, new_scores], dim=2)  # pad() is slower
            if new_tokens is not None:
                self.tokens = torch.cat([self.tokens, new_tokens], dim=-1)
        self.seen += c
        band = self.policy.band()
        visible = n + c if band is None else min(n + c, sum(band) + 1)  # the last query sees the most
        self.max_keys = max(self.max_keys, visible)
        keys = self.keys if self.roller is None else self.roller.rotate(self.keys, 0, n + c)
        return keys, self.values

    def _fills(self, room: list[torch.Tensor | None], slots: int) -> bool:
        """Whether `room` (`_room`) is still under the layer's tensors and exactly as long as `slots`, and may be
        written here (an inference tensor only in inference mode)."""
        keys = room[0]
        assert keys is not None and self.keys is not None
        return (
            keys.shape[2] == slots
            and keys.data_ptr() == self.keys.data_ptr()
            and (not keys.is_inference() or torch.is_inference_mode_enabled())
        )

    def gumbel_draws(self, length: int, group: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The Gumbel noise (batch, kv_heads, group, length, entries) and temperatures (length,) of the `length`
        queries now attending (the last ones appended) over the entries held (policies/score_updates.py)."""
        queries = torch.arange(self.seen - length, self.seen, device=self.device)
        return score_updates.gumbel_draws(self.policy, self.index, queries, self._entries()[2], group, dtype)

    def after_attention(self, received: torch.Tensor | None, steps: int = 1, more_blocks: bool = False) -> None:
        """Fold the attention each entry just received (batch, kv_heads, n) from the forward's `steps` queries into
        the scores (the policy's `update_scores`), then cut back to the budget. `more_blocks`: a block of a scanned
        forward that is not its last."""
        if received is not None:
            assert self.scores is not None  # attention reports what entries received only to a policy with scores
            self.policy.update_scores(self.scores, received, steps=steps)
        budget = self.policy.budget
        if budget is None or self.slots <= budget:
            return
        if self.plan.fair and (more_blocks or (steps > 1 and self.slots == budget + 1)):
            # The next block's (or fair chunk's) make_room cuts once, to where this cut and its own would end together:
            # one gather per tensor instead of two. Exact mode's steps cut at once (make_room(1) would not cut less).
            return
        self._cut(self.policy)

    @property
    def cut_pending(self) -> bool:
        """Whether the cut to the budget was left to the next make_room (`after_attention`): every other cut leaves
        at most the budget, so this is just holding more."""
        budget = self.policy.budget
        return budget is not None and self.slots > budget

    def settle(self) -> None:
        """Make a pending cut (see `after_attention`) now: the layer then holds at most budget entries."""
        if self.cut_pending:
            self._cut(self.policy)

    def make_room(self, length: int) -> None:
        """Before a fair chunk of `length` tokens: cut to budget + 1 - length entries with the policy's choice at that
        budget, so that the chunk's last query sees budget + 1 keys (see the module docstring)."""
        budget = self.policy.budget
        assert budget is not None  # fair chunks are a bounded policy's (cache.py)
        kept = budget + 1 - length
        if kept >= self.slots:
            return
        if kept not in self._reduced:
            self._reduced[kept] = self.policy.reduced(kept)
        if self.cut_pending and kept < budget and not self.policy.cuts_nest:
            self._cut(self.policy, then=self._reduced[kept], room=length)  # the pending cut and this one, as one
        else:
            self._cut(self._reduced[kept], room=length)

    def _cut(self, policy: EvictionPolicy, then: EvictionPolicy | None = None, room: int = 0) -> None:
        """Keep the `policy.budget` slots `policy` chooses (with `then`: of those, the `then.budget` slots `then`
        chooses), in every per-slot tensor; with `room`, in tensors `room` slots longer (`_room`) for the next append
        to fill."""
        budget = policy.budget if then is None else then.budget
        assert budget is not None  # only a bounded policy cuts
        rows = self._kept_rows(policy, then)
        keys, values, positions = self._entries()
        self.evicted += positions.numel() - rows.numel()
        if policy.eviction == "merge":  # what goes is merged into the entries after it first
            assert self.scores is not None  # merging declares Scores("latest") (validation.py)
            kept = torch.zeros(positions.numel(), dtype=torch.bool, device=self.device).index_fill_(0, rows, True)
            values = policy.merged(values, positions, self.scores, kept.view(positions.shape), self.index)
        if room:  # each row's last kept slot again as a placeholder in the slots the append fills
            per_row = rows.view(-1, budget)
            rows = torch.cat([per_row, per_row[:, -1:].expand(-1, room)], dim=1).view(-1)
        tensors = (keys, values, positions, self.scores, self.tokens)
        taken = [None if x is None else _take(x, rows, budget + room) for x in tensors]
        self._room = taken if room else None
        if room:
            taken = [None if x is None else x.narrow(2, 0, budget) for x in taken]
        self.keys, self.values, self.positions, self.scores, self.tokens = taken

    def _kept_rows(self, policy: EvictionPolicy, then: EvictionPolicy | None = None) -> torch.Tensor:
        """`policy`'s kept slots (with `then`: `policy.keep_twice`'s) as rows of the flattened (batch*heads*slots)
        storage.

        Band policies (sink, window) keep the same slots whenever the cache holds the same number of entries, so
        their answer is memoised: in steady state it is one dictionary lookup per layer and step.
        """
        keys, values, positions = self._entries()
        batch, heads, slots = positions.shape
        memo_key = (batch, heads, slots)
        banded = then is None and policy.band() is not None
        if banded and memo_key in self._rows_memo:
            return self._rows_memo[memo_key]
        extra: dict[str, torch.Tensor | int] = {}
        if policy.needs_keys:
            extra["keys"] = keys
        if policy.needs_values:
            extra["values"] = values
        if policy.needs_tokens:
            assert self.tokens is not None  # a layer carries token ids for a policy that reads them
            extra["tokens"] = self.tokens
        if policy.needs_layer:
            extra["layer"] = self.index
        if then is None:  # scores are None for a policy without them
            keep = policy.keep(positions, self.scores, **extra)
        else:
            keep = policy.keep_twice(then, positions, self.scores, **extra)
        if memo_key not in self._offsets_memo:  # where each (row, head)'s slots start in the flattened storage
            with outside_inference_mode():  # kept across forwards: memo.py
                flat_rows = torch.arange(batch * heads, device=keep.device)
                self._offsets_memo[memo_key] = flat_rows.view(batch, heads, 1) * slots
        rows = (keep + self._offsets_memo[memo_key]).reshape(-1)
        if banded:
            rows = self._rows_memo[memo_key] = ordinary(rows)
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
        self.keys = self.values = self.positions = self.scores = self.tokens = self._room = None
        self._workspace = None
        self.plan = LayerPlan(0)
        self.is_initialized = False
        self.seen = self.evicted = self.max_keys = 0

    @property
    def _score_dtype(self) -> torch.dtype:
        # float64 so that long sums of small probabilities rank entries stably (MPS has no float64). Counts above a
        # quantile are whole numbers (at most a window's queries times a group's query heads), exact in float32,
        # which halves what every chunk appends, shifts and gathers of a window as wide as scissorhands'.
        if self.device.type == "mps" or self.policy.score_quantile:
            return torch.float32
        return torch.float64

    def state(self) -> dict:
        """A snapshot (copies: scores are updated in place by later forwards), after any pending cut. A policy without
        scores gets zeros in their place, so that every snapshot (and checkpoint, and chat session) has one layout."""
        self.settle()
        names = ("keys", "values", "positions", "scores", "seen", "evicted", "max_keys")
        state = {k: getattr(self, k) for k in (*names, "tokens") if k in names or self.policy.needs_tokens}
        if self.scores is None and self.positions is not None:
            state["scores"] = torch.zeros(self.positions.shape, dtype=self._score_dtype, device=self.device)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}

    def load_state(self, state: dict) -> None:
        for k, v in state.items():
            setattr(self, k, v)
        if not self.policy.needs_scores:
            self.scores = None
        self.is_initialized = self.keys is not None
        if self.keys is not None:
            self.device = self.keys.device


def compiled_loop():
    """engine/compiled.py, or None where it cannot run or is switched off (engine/switch.py)."""
    return compiled_part("compiled")


def _take(x: torch.Tensor, rows: torch.Tensor, kept: int) -> torch.Tensor:
    """x (batch, heads, slots, *rest) at the kept slots. index_select on a flat view: CPU gather is ~10x slower."""
    batch, heads, slots = x.shape[:3]
    return x.reshape(batch * heads * slots, *x.shape[3:]).index_select(0, rows).view(batch, heads, kept, *x.shape[3:])
