"""The attention function h2o-stream registers with transformers, and the two hooks that give it its cache.

`attach(model)` switches the model to the registered attention implementation and hooks its base model: before a
forward that carries a `StreamingCache`, the hook sets the position ids the cache dictates (slot indices when rolling)
and makes the cache visible to the attention function; after the forward it hides it again. With any other cache (or
none) the attention function is plain SDPA, so an attached model still works as before.
"""

from __future__ import annotations

from contextvars import ContextVar

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .cache import StreamingCache

ATTENTION_NAME = "h2o_stream"
_active_cache: ContextVar[StreamingCache | None] = ContextVar("h2o_stream_cache", default=None)


def streaming_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    cache = _active_cache.get()
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer = cache.layers[module.layer_idx]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    mask = _full_mask(attention_mask, query.shape[-2], key.shape[-2], query.device)
    sink_query = cache.sink_queries(query, key.shape[-2])
    sinks = (layer.policy.band() or (0, 0))[0]
    plain = not layer.policy.needs_scores and kwargs.get("softcap") is None
    if plain and sink_query is not None and fused_sink_attention_applies(query, key, mask, sinks):
        output, received = attend_with_sink_queries(query, key, value, mask, scaling, sink_query, sinks), None
    elif not plain or sink_query is not None:
        output, received = attend_with_scores(query, key, value, mask, scaling, kwargs.get("softcap"), sink_query,
                                              sinks)
    else:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                enable_gqa=key.shape[1] != query.shape[1]).transpose(1, 2)
        received = None
    layer.after_attention(received if layer.policy.needs_scores else None)
    return output, None


def attend_with_scores(query, key, value, mask, scaling, softcap=None, sink_query=None, sinks=0):
    """Attention output (batch, q_len, q_heads, dim) and the probability each key received, summed over the queries
    and over the query heads that share its KV head: (batch, kv_heads, k_len).

    `sink_query`, if given, replaces the query for the first `sinks` key columns (see StreamingCache.sink_queries).
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    # Query head h reads KV head h // group (transformers' repeat_kv); grouping avoids materialising repeated keys.
    # Scaling the (small) query rather than the (q_len x k_len) logits saves a pass over the largest tensor here.
    logits = torch.matmul((query * scaling).reshape(batch, kv_heads, group * q_len, dim), key.transpose(-1, -2))
    if sink_query is not None:
        sink_logits = torch.matmul((sink_query * scaling).reshape(batch, kv_heads, group * q_len, dim),
                                   key[..., :sinks, :].transpose(-1, -2))
        logits = torch.cat([sink_logits, logits[..., sinks:]], dim=-1)
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    logits = logits.view(batch, kv_heads, group, q_len, k_len)
    if mask is not None:
        if mask.dtype == torch.bool:  # additive form on the small (q_len, k_len) mask, then one in-place add
            mask = torch.zeros(mask.shape, dtype=logits.dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
        logits.add_(mask.unsqueeze(2))  # (batch, 1, 1, q_len, k_len) against (batch, kv_heads, group, q_len, k_len)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    received = probs.sum(dim=(2, 3))
    output = torch.matmul(probs.to(value.dtype).view(batch, kv_heads, group * q_len, k_len), value)
    output = output.view(batch, q_heads, q_len, value.shape[-1]).transpose(1, 2)
    return output, received


def fused_sink_attention_applies(query, key, mask, sinks: int) -> bool:
    """The fused path needs torch's CPU flash kernel (it returns the log-sum-exp) and every query to see the sinks
    as ordinary past keys (the chunk starts after them), so that no row of the band part is empty."""
    return (query.device.type == "cpu" and _FLASH_CPU is not None and key.shape[-2] - query.shape[-2] >= sinks
            and query.dtype in (torch.float32, torch.float64) and mask is not None and mask.dtype == torch.bool)


def attend_with_sink_queries(query, key, value, mask, scaling, sink_query, sinks):
    """What `attend_with_scores` computes for a chunk whose sink columns need `sink_query`, without its explicit
    softmax over the whole (q_len, k_len) block: the band columns go through the fused kernel, the few sink columns
    are computed directly, and the two softmax parts are merged by their log-sum-exps. (batch, q_len, q_heads, dim)."""
    group = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    band = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, float("-inf"))
    band[..., :sinks] = float("-inf")
    band_out, band_lse = _FLASH_CPU(query, key, value, attn_mask=band, scale=scaling)[:2]
    sink_logits = torch.matmul(sink_query, key[..., :sinks, :].transpose(-1, -2)).mul_(scaling)
    top = torch.maximum(band_lse, sink_logits.amax(dim=-1))
    band_weight = torch.exp(band_lse - top).unsqueeze(-1)
    sink_weights = torch.exp(sink_logits - top.unsqueeze(-1))
    total = band_weight + sink_weights.sum(dim=-1, keepdim=True)
    output = (band_out * band_weight + torch.matmul(sink_weights, value[..., :sinks, :])) / total
    return output.transpose(1, 2)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _full_mask(attention_mask, q_len: int, k_len: int, device) -> torch.Tensor | None:
    """transformers drops the mask when it is implied (one query, or plain causal); make the implied one explicit."""
    if attention_mask is not None:
        return attention_mask
    if q_len == 1:
        return None
    rows = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(-1)
    return (torch.arange(k_len, device=device) <= rows)[None, None]


def _before_forward(module, args, kwargs):
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    if not isinstance(cache, StreamingCache):
        return None
    inputs = kwargs.get("input_ids")
    if inputs is None:
        inputs = kwargs.get("inputs_embeds")
    if inputs is None and args:
        inputs = args[0]
    kwargs["position_ids"], band_mask = cache.begin_forward(inputs.shape[1], inputs.device)
    if band_mask is not None:
        # A 4D mask is taken by transformers as-is; padding masks have no meaning for a single stream.
        kwargs["attention_mask"] = band_mask
    module._h2o_stream_tokens.append(_active_cache.set(cache))
    return args, kwargs


def _after_forward(module, args, kwargs, output):
    if isinstance(kwargs.get("cache", kwargs.get("past_key_values")), StreamingCache) and module._h2o_stream_tokens:
        _active_cache.reset(module._h2o_stream_tokens.pop())


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
