"""Small checks a `StreamingCache` makes of its budget, its model and the forwards it is given (cache.py): each
refuses with one clear H2OStreamError before anything changes."""

from __future__ import annotations

import torch

from ..errors import H2OStreamError


def _model_shape(config) -> tuple[int, int, int]:
    """(layers, KV heads, head dim): what a cache's storage is shaped by."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def model_signature(config) -> str:
    """A model as a policy setting may name it: its type and what a cache's storage is shaped by, e.g.
    'llama: 30 layers x 3 KV heads x 64' (a head classification made on one model is refused on another)."""
    layers, kv_heads, head_dim = _model_shape(config)
    return f"{getattr(config, 'model_type', 'unknown')}: {layers} layers x {kv_heads} KV heads x {head_dim}"


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
        raise H2OStreamError(
            "a StreamingCache builds the attention mask itself: pass no attention_mask, or a 2D "
            f"padding mask of ones, not a {attention_mask.dim()}D mask"
        )
    if not bool(attention_mask.all()):
        raise H2OStreamError(
            "padded batches are not supported: the attention_mask has zeros, and a StreamingCache would keep, "
            "score and position the padding as real tokens. Batch streams of equal length, or run them one at a time"
        )


def _check_context(policy, budget: int | None, context: int | None, rolling: bool) -> None:
    """Refuse a cache whose largest layer `budget` does not fit the model's `context` with rolling (a step needs
    budget + 1 positions); `policy` is the chosen one (with a per-layer schedule, `budget` is its lowest layer's)."""
    if rolling and budget is not None and context is not None and budget + 1 > context:
        if policy.layer_schedule is None:
            raise H2OStreamError(
                f"cache size {budget} does not fit the model's context of {context} positions "
                f"(a step needs budget + 1 positions); use a cache size of at most {context - 1}"
            )
        raise H2OStreamError(
            f"{policy.describe()} keeps {budget} entries in its lowest layer, which does not fit the model's "
            f"context of {context} positions (a step needs budget + 1 positions); use a smaller cache size"
        )


def _check_chunk(chunk_size: int, limit: int | None, policy) -> None:
    """Refuse a chunk size wider than `limit` (the cache's `max_chunk`) for a cache of the chosen `policy`."""
    if limit is not None and chunk_size > limit:
        where = "its smallest layer's budget" if policy.layer_schedule is not None else "the cache size"
        raise H2OStreamError(
            f"{policy.describe()} decides what to keep once per chunk, and a chunk of "
            f"{chunk_size} tokens over a cache of {limit} lets its queries see up to {limit + chunk_size} keys "
            f"instead of {limit + 1}: its results would not be comparable. Use a chunk size of at most {where} "
            f"({limit}), a larger cache, or exact (token-by-token) mode"
        )


def _check_stream_fits(tokens: int, *, rolling: bool, context: int | None, seen: int) -> None:
    """Refuse `tokens` more stream tokens, after `seen`, whose positions would pass the model's `context`; only
    without rolling (`StreamingCache.check_fits`)."""
    if rolling or context is None or seen + tokens <= context:
        return
    left = max(context - seen, 0)
    raise H2OStreamError(
        f"without rolling, tokens sit at their stream positions and the model has {context} positions: "
        f"{context} tokens fit in all and {left} more fit in this cache ({seen} fed so far), not "
        f"{tokens}. Keep rolling on (the default) if the model uses RoPE, or feed a shorter stream"
    )


def _check_token_ids(policy, inputs: torch.Tensor) -> None:
    """Refuse a forward of embeddings (`inputs` not token ids) for a `policy` that reads every entry's token id."""
    if policy.needs_tokens and (inputs.dim() != 2 or inputs.is_floating_point()):
        raise H2OStreamError(
            f"{policy.describe()} reads the token id of every entry: call the model with input_ids, not inputs_embeds"
        )


def _check_slots(start: int, slots: list[int] | None, length: int, *, rolling: bool, context: int | None) -> None:
    """Refuse a forward of `length` tokens from position `start` (or at `slots`, scanned) whose last position would
    pass the model's `context` with rolling."""
    last = start + length - 1 if slots is None else slots[-1]
    if rolling and context is not None and last >= context:
        raise H2OStreamError(
            f"a chunk of {length} tokens on top of {start} cached entries needs positions up to "
            f"{last}, beyond the model's context of {context}; use a smaller chunk or cache"
        )


def _check_same_model(model, made_for, shape: tuple[int, int, int]) -> None:
    """Refuse a forward of `model` (the base model running it, or None: not known) by a cache `made_for` another
    model, of storage `shape` (`_model_shape`)."""
    if model is None or model is made_for:
        return
    config = model.config.get_text_config(decoder=True)
    theirs = _model_shape(config)
    differs = "" if theirs == shape else f"; that one has {_describe(theirs)}"
    raise H2OStreamError(
        f"this StreamingCache was made for another model ({_describe(shape)})"
        f"{differs}: make a new StreamingCache for each model"
    )


def _check_batch(held: torch.Tensor | None, batch: int) -> None:
    """Refuse a forward's `batch` of streams other than the one the cache `held` (a layer's positions, or None)."""
    if held is not None and held.shape[0] != batch:
        raise H2OStreamError(
            f"this cache holds {held.shape[0]} stream(s) and the forward brings a batch of "
            f"{batch}: reset() the cache (or make a new one) before changing the batch size"
        )


def _check_positions(position_ids: torch.Tensor | None, seen: int, length: int) -> None:
    """The forward must bring tokens, and a caller's position ids must continue the stream of `seen` tokens the
    cache holds.

    model.generate slices its input by the tokens the cache has seen and passes position ids; given a prompt the
    cache already holds, it feeds a tail of it (or nothing) at positions the cache is long past.
    """
    if length and (position_ids is None or _continues(position_ids, seen, length)):
        return
    if length and position_ids is not None and position_ids.numel():  # (tokens without position ids returned above)
        first, last = position_ids.min().item(), position_ids.max().item()
        given = f"the forward's position ids ({first}..{last}) do not continue"
    else:
        given = "the forward brings no tokens to continue"
    raise H2OStreamError(
        f"{given} the stream this cache holds ({seen} tokens seen, so the next is at {seen}). "
        f"model.generate does this when given a prompt the cache already holds: pass the whole sequence so far, "
        f"or reset() the cache or make a new one"
    )
