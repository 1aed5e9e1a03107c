"""The attention function h2o-stream registers with transformers, and the two hooks that give it its cache.

`attach(model)` switches the model to the registered attention implementation and hooks its base model: before a
forward that carries a streaming cache (anything with `begin_forward`, i.e. a `StreamingCache`), the hook lets the
cache check the forward (one clear error for misuse, before the model runs), sets the position ids the cache dictates
(slot indices when rolling) and makes the cache visible to the attention function; after the forward it hides it
again. With any other cache (or none) the attention function is plain SDPA, so an attached model still works as
before. This module does not import the cache: the cache imports `attach`.

A forward with gradients off runs its base model under `torch.inference_mode` (entered by the first hook, left by
the second): every operation, the model's and the cache's, then skips autograd's bookkeeping (version counters,
view tracking), which is a measurable part of a CPU decode step. The LM head runs
after the second hook, so the logits a caller gets are ordinary tensors; hidden states the base model returns are
inference tensors (to change one in place, clone it first). The cache's entries become inference tensors, which a
later forward with gradients on only reads (each forward replaces them before it updates scores in place), and what
the engine memoises across forwards is made outside inference mode (memo.py), so the two kinds of forward mix.
"""

from __future__ import annotations

import dataclasses
import warnings
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .attention import (
    Extras,
    attend,
    attend_scoring_last_query,
    attend_with_sink_queries,
    causal_additive_mask,
    causal_mask,
    fused_sink_attention_applies,
    regularised_probabilities,
    sink_queries,
)

ATTENTION_NAME = "h2o_stream"
_active_cache: ContextVar = ContextVar("h2o_stream_cache", default=None)


def streaming_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = _active_cache.get()
    # Gemma 2's attention soft-capping and GPT-OSS's learned attention sinks (one extra logit per query head)
    extras = Extras(softcap=kwargs.get("softcap"), virtual_logits=kwargs.get("s_aux"))
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if cache is None:  # another cache or none: what the model would do without h2o-stream
        if extras.plain:
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
            )
        if attention_mask is None and query.shape[-2] > 1:  # transformers leaves out a mask that is only causal
            attention_mask = causal_mask(query.shape[-2], key.shape[-2], query.device)
        return attend(query, key, value, attention_mask, scaling, extras)[0], None
    layer = cache.layers[module.layer_idx]
    rows = getattr(layer, "rows", None)
    if rows is None:
        return _layer_attention(layer, query, key, value, scaling, extras), None
    # a RowsCache (engine/rows.py): every row attends over its own cache, as that cache alone would
    outputs = [
        _layer_attention(row, query[i : i + 1], *(layer.attend_to[i] or (None, None)), scaling, extras)
        for i, row in enumerate(rows)
    ]
    return torch.cat(outputs), None


_said: set[tuple[str, str]] = set()  # (path, what) said already


def say_once(path: str, what: str) -> None:
    """One warning per path and reason: a fast path that cannot take what a model's attention does falls back to
    the general one (the same numbers, slower)."""
    if (path, what) not in _said:
        _said.add((path, what))
        warnings.warn(
            f"the {path} does not take {what}: those layers run on the general attention path instead "
            "(the same numbers, slower)",
            stacklevel=2,
        )


def _layer_attention(layer, query, key, value, scaling, extras: Extras):
    """Attention of `query` over one StreamingLayer (a scan block by block, the fused sink path where it applies),
    with the layer's own mask (its band, or causal) and its queries at its own slots."""
    query = layer.move_query(query)
    if layer.plan.blocks is not None:
        return _scan(layer, query, key, value, scaling, extras)
    mask = layer.mask(query.shape[-2], key.shape[-2] - query.shape[-2], query.device)
    sinks = (layer.policy.band() or (0, 0))[0]
    sink_query = sink_queries(layer.roller, query, key.shape[-2] - query.shape[-2], layer.policy.budget, sinks)
    if (
        not layer.policy.needs_scores
        and sink_query is not None
        and fused_sink_attention_applies(query, key, mask, sinks)
    ):
        if extras.plain:
            output = attend_with_sink_queries(query, key, value, mask, scaling, sink_query, sinks)
            layer.after_attention(None, steps=query.shape[-2])
            return output
        say_once("fused sink attention kernel", extras.what)
    if sink_query is not None:
        extras = dataclasses.replace(extras, sink_query=sink_query, sink_columns=sinks)
    return _attend(layer, query, key, value, mask, scaling, extras)


def _attend(layer, query, key, value, mask, scaling, extras: Extras, more_blocks=False):
    """Attention of `query` over the layer's entries, their scores folded in and the layer cut (after_attention;
    `more_blocks`: a block of a scan that is not its last). The kernel gives the probabilities; the policy's scoring
    makes of them what each entry received (policies/scoring.py)."""
    policy = layer.policy
    received = None
    if (
        policy.score_queries == "last"
        and query.shape[-2] > 1
        and extras.plain
        and extras.sink_query is None
        and not policy.gumbel
    ):
        output, received = attend_scoring_last_query(query, key, value, mask, scaling)
        received = policy.scoring.rule.over_heads(policy, received, query.shape[1])
    elif policy.needs_scores or not extras.plain or extras.sink_query is not None:
        output, probs, logits = attend(query, key, value, mask, scaling, extras)
        if policy.needs_scores:
            if policy.gumbel:
                group = query.shape[1] // key.shape[1]
                probs = regularised_probabilities(logits, *layer.gumbel_draws(query.shape[-2], group, query.dtype))
            received = policy.scoring.rule.received(policy, probs, mask)
    else:
        output = F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        ).transpose(1, 2)
    layer.after_attention(received, steps=query.shape[-2], more_blocks=more_blocks)
    return output


def _scan(layer, query, keys, values, scaling, extras: Extras):
    """A scanned forward (`StreamingCache(decide_every=...)`, or exact mode's one-token steps) over the forward's
    `keys` and `values` (what the layer's `update` returned): the queries block by block (the layer's plan), each
    block's entries appended after the previous block's cut, as if every block were its own forward."""
    plan = layer.plan
    if plan.compiled and not extras.plain:
        say_once("compiled exact-mode loop", extras.what)
    elif plan.compiled and layer.roller is not None and layer.roller.pairs:
        say_once("compiled exact-mode loop", "interleaved rotary pairs")
    elif layer.compiles(query):
        return layer.compiled_steps(query, keys, values, scaling)
    outputs, start = [], 0
    for length in plan.blocks:
        key, value = layer.open_block(keys, values, start, length)
        mask = causal_additive_mask(length, key.shape[-2], query.device, query.dtype)
        block = query[..., start : start + length, :]
        more_blocks = start + length < keys.shape[-2]
        outputs.append(_attend(layer, block, key, value, mask, scaling, extras, more_blocks=more_blocks))
        start += length
    return torch.cat(outputs, dim=1)


def _before_forward(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not _is_streaming(cache):
        return None
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    inference = _enter_inference_mode()
    try:
        # The cache checks the forward (model, batch, padding, positions, chunk, context) before anything runs.
        kwargs["position_ids"], band_mask = cache.begin_forward(
            inputs, model=module, position_ids=kwargs.get("position_ids"), attention_mask=kwargs.get("attention_mask")
        )
    except BaseException:
        _leave(inference)
        raise
    if band_mask is not None:
        # A 4D mask is taken by transformers as-is; begin_forward refused padding, so nothing is lost here.
        kwargs["attention_mask"] = band_mask
    module._h2o_stream_tokens.append((_active_cache.set(cache), inference))
    return args, kwargs


def _after_forward(module, args, kwargs, output):
    if _is_streaming(kwargs.get("cache", kwargs.get("past_key_values"))) and module._h2o_stream_tokens:
        token, inference = module._h2o_stream_tokens.pop()
        _active_cache.reset(token)
        _leave(inference)


def _enter_inference_mode() -> torch.inference_mode | None:
    """Enter `torch.inference_mode` for a forward with gradients off (see the module docstring); None when
    gradients are on or inference mode already holds."""
    if torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return None
    context = torch.inference_mode()
    context.__enter__()
    return context


def _leave(inference: torch.inference_mode | None) -> None:
    if inference is not None:
        inference.__exit__(None, None, None)


def attach(model) -> None:
    """Make `model` run h2o-stream attention when given a StreamingCache (idempotent)."""
    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, streaming_attention)
        AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
    base = model.base_model
    if not hasattr(base, "_h2o_stream_tokens"):
        base._h2o_stream_tokens = []
        base.register_forward_pre_hook(_before_forward, with_kwargs=True)
        base.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)


def active_cache():
    """The streaming cache of the forward now running on this thread/context, or None."""
    return _active_cache.get()


def _is_streaming(cache) -> bool:
    return callable(getattr(cache, "begin_forward", None))
