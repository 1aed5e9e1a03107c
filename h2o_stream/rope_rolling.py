"""Position rolling: cached keys are used as if rotated to their current slot, the query at the next slot.

The cache stores keys *un-rotated* and rotates them to slots 0..n-1 for every forward pass, from cos/sin tables that
the model's own rotary module computes (so rope scaling types, the attention scaling factor and partial rotary dims all
follow the model). A key is un-rotated once, when it arrives, with the very cos/sin the model rotated it with; after
that it is only ever rotated from its stored form, never re-rotated in place, so a million renumberings add no drift.
"""

from __future__ import annotations

import torch
from torch import nn

from .errors import H2OStreamError

# Model families whose attention rotates the first `rotary_dim` dims of q and k with the rotate-half convention
# (x * cos + rotate_half(x) * sin), gets cos/sin from `<base model>.rotary_emb(x, position_ids)`, and calls
# `cache.update` after the rotation. Families that rotate interleaved pairs (e.g. cohere, glm) are not listed.
ROTATE_HALF_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "gpt_neox", "gemma",
    "stablelm", "olmo", "olmo2", "granite", "smollm3", "starcoder2", "helium",
})


class RopeRoller:
    """cos/sin for slot positions, and the rotation and exact un-rotation of keys.

    Tables are memoised by length: within one forward every layer shares them, and in steady state the length
    (cache size + chunk) repeats, so they are computed once. The model's rotary module is called with positions
    0..length-1, the same elementwise computation the model does for the query, so the values agree bit for bit.
    """

    def __init__(self, rotary: nn.Module, head_dim: int):
        self.rotary = rotary
        self.head_dim = head_dim
        self._tables: dict[tuple[int, torch.device], dict[str, torch.Tensor]] = {}

    @classmethod
    def for_model(cls, model: nn.Module) -> RopeRoller:
        config = model.config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", "?")
        rotary = getattr(model.base_model, "rotary_emb", None)
        if model_type not in ROTATE_HALF_FAMILIES or rotary is None:
            supported = ", ".join(sorted(ROTATE_HALF_FAMILIES))
            raise H2OStreamError(
                f"position rolling needs a rotary (RoPE) model of a known family; {model_type!r} is not one "
                f"(supported: {supported}). Pass --no-rolling to keep true stream positions instead.")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(rotary, head_dim)

    def table(self, length: int, device: torch.device) -> dict[str, torch.Tensor]:
        """Per-position factors for positions 0..length-1, each (length, rotary_dim), float32.

        rotate(x) = x*cos + roll(x)*sin_rh, where roll(x) swaps the two halves and sin_rh carries rotate_half's sign;
        unrotate uses ucos/usin_rh, the same with -sin and divided by cos²+sin² (the square of the model's attention
        scaling factor, 1 for plain RoPE), which makes it the exact inverse of the model's scaled rotation.
        """
        key = (length, device)
        if key not in self._tables:
            if len(self._tables) > 8:
                self._tables.clear()
            # Ordinary tensors even inside an inference-mode forward: any later forward may use them (engine/memo.py).
            with torch.inference_mode(False), torch.no_grad():
                probe = torch.zeros(1, dtype=torch.float32, device=device)
                positions = torch.arange(length, device=device).unsqueeze(0)
                cos, sin = self.rotary(probe, positions)
                cos, sin = cos[0].float(), sin[0].float()
                half = cos.shape[-1] // 2
                sign = torch.cat([-torch.ones(half, device=device), torch.ones(half, device=device)])
                inv_norm = 1.0 / (cos * cos + sin * sin)
                self._tables[key] = {"cos": cos, "sin_rh": sin * sign, "ucos": cos * inv_norm,
                                     "usin_rh": -sin * sign * inv_norm, "rows": {}}
        return self._tables[key]

    def rotate(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """x (..., L, head_dim) rotated to positions start..stop-1 (L = stop - start)."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=False))

    def unrotate(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """Inverse of the model's rotation of x at positions start..stop-1."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=True))

    def rotate_capped(self, x: torch.Tensor, start: int, stop: int, cap: int) -> torch.Tensor:
        """x (..., L, head_dim) rotated to positions min(p, cap) for p = start..stop-1 (queries moved back to the
        slot exact mode gives them relative to the sinks)."""
        return _apply(x, *self._rows(start, stop, x.device, inverse=False, cap=cap))

    def _rows(self, start: int, stop: int, device: torch.device, *, inverse: bool, cap: int | None = None):
        """(cos, sin_rh) of the table for `stop` at positions start..stop-1 (each at most `cap`, if given),
        memoised with the table: every layer and step asks for the same few."""
        t = self.table(stop, device)
        key = (start, inverse, cap)
        if key not in t["rows"]:
            cos, sin_rh = (t["ucos"], t["usin_rh"]) if inverse else (t["cos"], t["sin_rh"])
            if cap is None:
                t["rows"][key] = (cos[start:], sin_rh[start:])
            else:
                with torch.inference_mode(False), torch.no_grad():  # kept, as the table
                    positions = torch.arange(start, stop, device=device).clamp(max=cap)
                    t["rows"][key] = (cos[positions], sin_rh[positions])
        return t["rows"][key]


def _apply(x: torch.Tensor, cos: torch.Tensor, sin_rh: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    partial = rotary_dim != x.shape[-1]
    x_rot = x[..., :rotary_dim] if partial else x
    if x_rot.dtype != torch.float32:
        x_rot = x_rot.float()
    # x*cos + roll(x, half)*sin_rh: roll swaps the halves, sin_rh carries rotate_half's sign. On torch 2.13 this is
    # faster than writing the halves in place (three operations instead of a dozen slices) and equal bit for bit.
    out = torch.addcmul(x_rot * cos, x_rot.roll(rotary_dim // 2, dims=-1), sin_rh)
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return torch.cat((out, x[..., rotary_dim:]), dim=-1) if partial else out
