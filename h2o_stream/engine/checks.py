"""Small checks a `StreamingCache` makes of the forwards it is given (cache.py)."""

from __future__ import annotations

import torch

from ..errors import H2OStreamError


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
