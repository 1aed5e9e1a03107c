"""Position rolling: cached keys are used as if rotated to their current slot, the query at the next slot.

The cache stores keys *un-rotated* and rotates them to slots 0..n-1 for every forward pass, from cos/sin tables that
the model's own rotary module computes (so rope scaling types, the attention scaling factor and partial rotary dims all
follow the model). A key is un-rotated once, when it arrives, with the very cos/sin the model rotated it with; after
that it is only ever rotated from its stored form, never re-rotated in place, so a million renumberings add no drift.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import TYPE_CHECKING, TypedDict

import torch
from torch import nn

from .errors import H2OStreamError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Model families whose attention rotates the first `rotary_dim` dims of q and k with x * cos + rotate_half(x) * sin,
# gets cos/sin from `<base model>.rotary_emb(x, position_ids[, layer_type])`, and calls `cache.update` after the
# rotation. The layout says how `rotate_half` pairs the dimensions: "half" swaps the two halves (Llama), "pairs" swaps
# neighbours (Cohere's interleaved rotation), "half_tables" is "half" with cos/sin given for one half only (GPT-OSS).
ROPE_FAMILIES = {
    **dict.fromkeys(
        (
            "llama",
            "mistral",
            "mixtral",
            "qwen2",
            "qwen2_moe",
            "qwen3",
            "qwen3_moe",
            "phi",
            "phi3",
            "gpt_neox",
            "gemma",
            "gemma2",
            "gemma3_text",
            "stablelm",
            "olmo",
            "olmo2",
            "granite",
            "smollm3",
            "starcoder2",
            "helium",
        ),
        "half",
    ),
    "cohere2": "pairs",
    "gpt_oss": "half_tables",
}
ROTATE_HALF_FAMILIES = frozenset(ROPE_FAMILIES)  # the families rolling knows (name kept for callers)

# Families whose layers of some types use no positions at all (NoPE): Cohere2's global layers. Such a layer needs no
# roller: its keys are stored as the model made them, and its slots are only an order.
_NOPE_LAYERS = {"cohere2": frozenset({"full_attention"})}

#: where a table's memoised (cos, sin_rh) rows are: (start, inverse, cap) for `_rows`, ("at", positions, inverse) for
#: `_rows_at`
_RowsKey = tuple[int, bool, int | None] | tuple[str, range | tuple[int, ...], bool]


class RopeTable(TypedDict):
    """`RopeRoller.table`: the factors, each (length, rotary_dim) float32, and the rows memoised from them."""

    cos: torch.Tensor
    sin_rh: torch.Tensor
    ucos: torch.Tensor
    usin_rh: torch.Tensor
    rows: dict[_RowsKey, tuple[torch.Tensor, torch.Tensor]]


class RopeRoller:
    """cos/sin for slot positions, and the rotation and exact un-rotation of keys.

    Tables are memoised by length: within one forward every layer shares them, and in steady state the length
    (cache size + chunk) repeats, so they are computed once. The model's rotary module is called with positions
    0..length-1, the same elementwise computation the model does for the query, so the values agree bit for bit.
    """

    def __init__(self, rotary: nn.Module, head_dim: int, layer_type: str | None = None, layout: str = "half"):
        self.rotary = rotary
        self.head_dim = head_dim
        self.layer_type = layer_type  # passed to a rotary module that serves several layer types (Gemma 3)
        self.layout = layout
        self._tables: OrderedDict[tuple[int, torch.device], RopeTable] = OrderedDict()

    @classmethod
    def for_model(cls, model: PreTrainedModel) -> RopeRoller:
        """The roller of the model's first layer that uses positions (see `for_layers`)."""
        return next(roller for roller in cls.for_layers(model) if roller is not None)

    @classmethod
    def for_layers(cls, model: PreTrainedModel) -> list[RopeRoller | None]:
        """One roller per layer, with that layer's own rotary parameters: layers of one type share one (Gemma 3's
        local and global layers have their own bases and scaling); None for a layer without positions (NoPE)."""
        config = model.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", "?")
        rotary = getattr(model.base_model, "rotary_emb", None)
        if model_type not in ROPE_FAMILIES or rotary is None:
            supported = ", ".join(sorted(ROPE_FAMILIES))
            raise H2OStreamError(
                f"position rolling needs a rotary (RoPE) model of a known family; {model_type!r} is not one "
                f"(supported: {supported}). Pass --no-rolling to keep true stream positions instead."
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        per_type = "layer_type" in inspect.signature(rotary.forward).parameters
        nope = _NOPE_LAYERS.get(model_type, frozenset())
        rollers: dict[str, RopeRoller] = {}
        for kind in set(types) - nope:
            rollers[kind] = cls(rotary, head_dim, kind if per_type else None, ROPE_FAMILIES[model_type])
        if not per_type and rollers:  # one rotary module for every layer: one roller, one set of tables
            rollers = dict.fromkeys(rollers, next(iter(rollers.values())))
        return [rollers.get(kind) for kind in types]

    def table(self, length: int, device: torch.device) -> RopeTable:
        """Per-position factors for positions 0..length-1, each (length, rotary_dim), float32.

        rotate(x) = x*cos + roll(x)*sin_rh, where roll(x) swaps the two halves and sin_rh carries rotate_half's sign;
        unrotate uses ucos/usin_rh, the same with -sin and divided by cos²+sin² (the square of the model's attention
        scaling factor, 1 for plain RoPE), which makes it the exact inverse of the model's scaled rotation.
        """
        key = (length, device)
        if key in self._tables:
            self._tables.move_to_end(key)
        else:
            if len(self._tables) >= _TABLES_KEPT:  # the least recently used goes
                self._tables.popitem(last=False)
            # Ordinary tensors even inside an inference-mode forward: any later forward may use them (engine/memo.py).
            with torch.inference_mode(False), torch.no_grad():
                probe = torch.zeros(1, dtype=torch.float32, device=device)
                positions = torch.arange(length, device=device).unsqueeze(0)
                extra = () if self.layer_type is None else (self.layer_type,)
                cos, sin = self.rotary(probe, positions, *extra)
                cos, sin = cos[0].float(), sin[0].float()
                if self.layout == "half_tables":  # one half given: the same factors serve both halves
                    cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
                half = cos.shape[-1] // 2
                if self.layout == "pairs":  # rotate_half of interleaved pairs: (-x1, x0, -x3, x2, ...)
                    sign = torch.tensor([-1.0, 1.0], device=device).repeat(half)
                else:
                    sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])
                inv_norm = 1.0 / (cos * cos + sin * sin)
                self._tables[key] = {
                    "cos": cos,
                    "sin_rh": sin * sign,
                    "ucos": cos * inv_norm,
                    "usin_rh": -sin * sign * inv_norm,
                    "rows": {},
                }
        return self._tables[key]

    def rotate(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x (..., L, head_dim) rotated to positions start..stop-1 (L = stop - start)."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=False), self.pairs)

    def unrotate(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Inverse of the model's rotation of x at positions start..stop-1."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=True), self.pairs)

    def rotate_capped(self, x: torch.Tensor, start: int, stop: int, cap: int) -> torch.Tensor:
        """x (..., L, head_dim) rotated to positions min(p, cap) for p = start..stop-1 (queries moved back to the
        slot exact mode gives them relative to the sinks)."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=False, cap=cap), self.pairs)

    def move(self, x: torch.Tensor, rotated_at: range | tuple[int, ...], to: range | tuple[int, ...]) -> torch.Tensor:
        """x (..., L, head_dim), rotated by the model at positions `rotated_at`, as if rotated at `to` instead
        (un-rotated exactly, then rotated once: a layer whose slots are not the positions the model was given)."""
        raw = _apply(x, *self._rows_at(rotated_at, x.device, inverse=True), self.pairs)
        return _apply(raw, *self._rows_at(to, x.device, inverse=False), self.pairs)

    @property
    def pairs(self) -> bool:
        return self.layout == "pairs"

    def _rows_at(
        self, positions: range | tuple[int, ...], device: torch.device, *, inverse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_rh) at any positions (a range or a tuple), memoised with the table of their largest."""
        if isinstance(positions, range) and positions.step == 1:
            return self._rows(positions.start, positions.stop, device, inverse=inverse)
        t = self.table(max(positions) + 1, device)
        key: _RowsKey = ("at", positions, inverse)
        if key not in t["rows"]:
            if len(t["rows"]) > 64:  # a scan's slot lists repeat in steady state; only warm-up makes new ones
                t["rows"].clear()
            cos, sin_rh = (t["ucos"], t["usin_rh"]) if inverse else (t["cos"], t["sin_rh"])
            with torch.inference_mode(False), torch.no_grad():  # kept, as the table
                index = torch.tensor(positions, device=device)
                t["rows"][key] = (cos[index], sin_rh[index])
        return t["rows"][key]

    def _rows(
        self, start: int, stop: int, device: torch.device, *, inverse: bool, cap: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin_rh) of the table for `stop` at positions start..stop-1 (each at most `cap`, if given),
        memoised with the table: every layer and step asks for the same few."""
        t = self.table(stop, device)
        key: _RowsKey = (start, inverse, cap)
        if key not in t["rows"]:
            cos, sin_rh = (t["ucos"], t["usin_rh"]) if inverse else (t["cos"], t["sin_rh"])
            if cap is None:
                t["rows"][key] = (cos[start:], sin_rh[start:])
            else:
                with torch.inference_mode(False), torch.no_grad():  # kept, as the table
                    positions = torch.arange(start, stop, device=device).clamp(max=cap)
                    t["rows"][key] = (cos[positions], sin_rh[positions])
        return t["rows"][key]


#: rotation tables kept per roller, by length: a layer at slots of its own asks for its own lengths every forward (a
#: per-layer schedule gives each layer one), and a table is rebuilt from the rotary module when it is not kept
_TABLES_KEPT = 48


def _apply(x: torch.Tensor, cos: torch.Tensor, sin_rh: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    partial = rotary_dim != x.shape[-1]
    x_rot = x[..., :rotary_dim] if partial else x
    if x_rot.dtype != torch.float32:
        x_rot = x_rot.float()
    # x*cos + roll(x, half)*sin_rh: roll swaps the halves, sin_rh carries rotate_half's sign. On torch 2.13 this is
    # faster than writing the halves in place (three operations instead of a dozen slices) and equal bit for bit.
    # Interleaved pairs swap neighbours instead.
    swapped = x_rot.unflatten(-1, (-1, 2)).flip(-1).flatten(-2) if pairs else x_rot.roll(rotary_dim // 2, dims=-1)
    out = torch.addcmul(x_rot * cos, swapped, sin_rh)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return torch.cat((out, x[..., rotary_dim:]), dim=-1) if partial else out
