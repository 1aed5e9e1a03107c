"""Attention kernels: attention that also gives its probabilities (of which a policy's scoring makes what each key
received: policies/scoring.py), the fused path scoring the latest query, and the fused path for chunked sink
attention. Pure tensor functions; the cache and the hooks that call them live elsewhere."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .memo import memoised
from .switch import compiled_part


@dataclass(frozen=True)
class Extras:
    """What a forward's attention adds to plain softmax attention: the model's logit soft-capping and learned sink
    logits, and the engine's sink queries."""

    softcap: float | None = None
    #: (q_heads,) the logit of a virtual key without a value that takes its share of every query's softmax (GPT-OSS's
    #: learned sinks); the probabilities reported are those of the real keys
    virtual_logits: torch.Tensor | None = None
    #: queries that replace the query for the first `sink_columns` key columns (see `sink_queries`)
    sink_query: torch.Tensor | None = None
    sink_columns: int = 0

    @property
    def plain(self) -> bool:
        """Whether the model's attention adds nothing (no soft-capping, no learned sink logits)."""
        return self.softcap is None and self.virtual_logits is None

    @property
    def what(self) -> str:
        return " and ".join(
            n
            for n, v in (("logit soft-capping", self.softcap), ("learned sink logits", self.virtual_logits))
            if v is not None
        )


PLAIN = Extras()


def attend(query, key, value, mask, scaling, extras: Extras = PLAIN):
    """Attention output (batch, q_len, q_heads, dim), the probabilities (batch, kv_heads, group, q_len, k_len) in
    float32 (query head h reads KV head h // group) and the logits they are the softmax of (masked; the query's dtype),
    from which a scoring makes what each key received (policies/scoring.py)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, k_len = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    # Query head h reads KV head h // group (transformers' repeat_kv); grouping avoids materialising repeated keys.
    # Scaling the (small) query rather than the (q_len x k_len) logits saves a pass over the largest tensor here.
    logits = torch.matmul((query * scaling).reshape(batch, kv_heads, group * q_len, dim), key.transpose(-1, -2))
    if extras.sink_query is not None:
        sinks = extras.sink_columns
        sink_logits = torch.matmul(
            (extras.sink_query * scaling).reshape(batch, kv_heads, group * q_len, dim),
            key[..., :sinks, :].transpose(-1, -2),
        )
        logits = torch.cat([sink_logits, logits[..., sinks:]], dim=-1)
    if extras.softcap is not None:
        logits = torch.tanh(logits / extras.softcap) * extras.softcap
    logits = logits.view(batch, kv_heads, group, q_len, k_len)
    if mask is not None:
        if mask.dtype == torch.bool:  # additive form on the small (q_len, k_len) mask, then one in-place add
            mask = additive_mask(mask, logits.dtype)
        logits.add_(mask.unsqueeze(2))  # (batch, 1, 1, q_len, k_len) against (batch, kv_heads, group, q_len, k_len)
    if extras.virtual_logits is None:
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        virtual = extras.virtual_logits.to(logits.dtype).view(1, kv_heads, group, 1, 1).expand(batch, -1, -1, q_len, 1)
        probs = torch.softmax(torch.cat([logits, virtual], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
        probs = probs.contiguous()
    output = torch.matmul(probs.to(value.dtype).view(batch, kv_heads, group * q_len, k_len), value)
    output = output.view(batch, q_heads, q_len, value.shape[-1]).transpose(1, 2)
    return output, probs, logits


def regularised_probabilities(logits: torch.Tensor, noise: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Gumbel-regularised probabilities (batch, kv_heads, group, q_len, k_len) in float32 from `attend`'s `logits`,
    the `noise` of the same shape and each query's temperature (q_len,): what Gumbel scores count in place of the
    model's own probabilities."""
    return torch.softmax(
        (logits + noise) / temperatures.to(logits.dtype).view(1, 1, 1, -1, 1), dim=-1, dtype=torch.float32
    )


def attend_scoring_last_query(query, key, value, mask, scaling):
    """What `attend` and the latest query's scoring (`LATEST.gathered`) give for plain attention (no soft-capping,
    sink queries, virtual logits or draws), the same up to float rounding: every query's output from torch's fused
    attention, and only the last query's probabilities made explicitly (batch, kv_heads, k_len), its query heads
    summed. A chunk of
    a policy that scores the latest query need not write out the (q_len x k_len) probabilities of the others."""
    batch, q_heads, _, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    output = F.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scaling, enable_gqa=group > 1
    ).transpose(1, 2)
    logits = torch.matmul((query[..., -1:, :] * scaling).reshape(batch, kv_heads, group, dim), key.transpose(-1, -2))
    if mask is not None:  # the last query's row of the mask (batch, 1, q_len, k_len)
        last = mask[:, :, -1:, :]
        logits = logits.masked_fill(~last, float("-inf")) if last.dtype == torch.bool else logits + last
    return output, torch.softmax(logits, dim=-1, dtype=torch.float32).sum(dim=2)


def window_counts(probs: torch.Tensor, mask: torch.Tensor | None, quantile: float) -> torch.Tensor:
    """(batch, kv_heads, k_len, q_len): per key and query, how many of the KV head's query heads gave the key more
    than the `quantile` of their row (`above_quantile`, summed over the group; float32, exact for whole numbers).
    Compiled where it can be (engine/compiled_counts.py: the same numbers in one pass), else on tensors."""
    counting = compiled_part("compiled_counts")
    if counting is None or probs.device.type != "cpu" or probs.dtype not in (torch.float32, torch.float64):
        return above_quantile(probs, mask, quantile).sum(dim=2, dtype=torch.float32).transpose(-1, -2)
    index = threshold_index(probs, mask, quantile).reshape(-1, probs.shape[-2]).expand(probs.shape[0], -1)
    return counting.counts_above(probs, index.contiguous())


def above_quantile(probs: torch.Tensor, mask: torch.Tensor | None, quantile: float) -> torch.Tensor:
    """1.0 where a key got more than the `quantile` of its row, else 0.0: probs (batch, kv_heads, group, q_len, k_len),
    `mask` the rows' additive mask (batch, 1, q_len, k_len), or None where every query sees every key. A row's
    quantile is the value at ascending index floor(quantile * n) (at most n - 1) of the n keys it sees; the keys it
    does not see (probability 0) sort first, so that value is at index (k_len - n) + that index of the whole row."""
    k_len = probs.shape[-1]
    index = threshold_index(probs, mask, quantile)
    # The value at ascending index i is the (k_len - 1 - i)-th of the row's largest: the few largest of every row
    # (one partial sort) hold every row's threshold, where sorting whole rows took most of a chunk's time.
    from_top = (k_len - 1) - index.expand(*probs.shape[:-1])
    largest = probs.topk(int(from_top.max()) + 1, dim=-1).values
    threshold = largest.gather(-1, from_top.unsqueeze(-1))
    return (probs > threshold).to(probs.dtype)


def threshold_index(probs: torch.Tensor, mask: torch.Tensor | None, quantile: float) -> torch.Tensor:
    """Where each row's quantile sits in the ascending whole row of `probs` (batch, kv_heads, group, q_len, k_len):
    (k_len - n) + min(floor(quantile * n), n - 1), n the keys the row sees by the additive `mask` (batch, 1, q_len,
    k_len; None: every key), as (batch or 1, 1, 1, q_len) int64 (see `above_quantile`). Memoised by the mask object
    (every layer of a forward shares it); never modify the result."""
    return _threshold_index(mask, quantile, *probs.shape[-2:], probs.device)


@memoised(64)
def _threshold_index(mask: torch.Tensor | None, quantile: float, q_len: int, k_len: int, device) -> torch.Tensor:
    if mask is None:
        seen = torch.full((q_len,), k_len, device=device).view(1, 1, 1, -1)
    else:
        seen = torch.isfinite(mask).sum(-1).unsqueeze(1)
    # floor(quantile * n) in float64, as Python takes it
    return (k_len - seen) + torch.clamp((quantile * seen.to(torch.float64)).floor().long(), max=seen - 1)


def fused_sink_attention_applies(query, key, mask, sinks: int) -> bool:
    """The fused path needs torch's CPU flash kernel (it returns the log-sum-exp) and every query to see the sinks
    as ordinary past keys (the chunk starts after them), so that no row of the band part is empty."""
    return (
        query.device.type == "cpu"
        and _FLASH_CPU is not None
        and key.shape[-2] - query.shape[-2] >= sinks
        and query.dtype in (torch.float32, torch.float64)
        and mask is not None
        and mask.dtype == torch.bool
    )


def attend_with_sink_queries(query, key, value, mask, scaling, sink_query, sinks):
    """What `attend` computes for a chunk whose sink columns need `sink_query`, without its explicit
    softmax over the whole (q_len, k_len) block: the band columns go through the fused kernel, the few sink columns
    are computed directly, and the two softmax parts are merged by their log-sum-exps. (batch, q_len, q_heads, dim)."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = q_heads // kv_heads
    # Query head h reads KV head h // group: each group's queries become rows of its KV head (as in
    # `attend`), where repeating the keys and values for every query head copied them in every layer.
    rows = (batch, kv_heads, group * q_len, dim)
    band = band_bias(mask, sinks, group, query.dtype)
    band_out, band_lse = _FLASH_CPU(query.reshape(rows), key, value, attn_mask=band, scale=scaling)[:2]
    sink_logits = torch.matmul(sink_query.reshape(rows), key[..., :sinks, :].transpose(-1, -2)).mul_(scaling)
    top = torch.maximum(band_lse, sink_logits.amax(dim=-1))
    band_weight = torch.exp(band_lse - top).unsqueeze(-1)
    sink_weights = torch.exp(sink_logits - top.unsqueeze(-1))
    total = band_weight + sink_weights.sum(dim=-1, keepdim=True)
    output = (band_out * band_weight + torch.matmul(sink_weights, value[..., :sinks, :])) / total
    return output.view(batch, q_heads, q_len, value.shape[-1]).transpose(1, 2)


_MEMOISED_BAND_BYTES = 8 << 20  # 256-token chunks over 512 keys with 3 query heads per KV head: 1.5 MB


def band_bias(mask: torch.Tensor, sinks: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The band part of a banded bool `mask` (batch, 1, q_len, k_len) in additive form, its sink columns closed (they
    are computed apart), repeated for the `group` query heads folded into its rows: (batch, 1, group * q_len, k_len).
    Memoised by the mask object, which every layer of a forward shares (and the cache reuses across forwards of one
    shape), unless it is large (very wide chunks), where keeping it would cost more memory than rebuilding costs time.
    Never modify either."""
    if mask.numel() * group * torch.finfo(dtype).bits // 8 > _MEMOISED_BAND_BYTES:
        return _band_bias(mask, sinks, group, dtype)
    return _memoised_band_bias(mask, sinks, group, dtype)


def _band_bias(mask: torch.Tensor, sinks: int, group: int, dtype: torch.dtype) -> torch.Tensor:
    band = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    band[..., :sinks] = float("-inf")
    return band.repeat(1, 1, group, 1) if group > 1 else band


_memoised_band_bias = memoised(8)(_band_bias)


_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


@memoised(16)
def band_mask(sinks: int, recent: int, n: int, length: int, device: torch.device) -> torch.Tensor:
    """For sink/window chunks: query i (slot n+i) sees slots j <= n+i with j < sinks or j >= n+i-recent, exactly the
    keys exact mode would give it. (1, 1, length, n+length) bool, True = attend. Memoised: in steady state every
    forward has the same shape, so the attention's derived masks (`band_bias`) are memoised too. Never modify it."""
    query_slot = torch.arange(n, n + length, device=device).unsqueeze(-1)
    key_slot = torch.arange(n + length, device=device)
    visible = (key_slot <= query_slot) & ((key_slot < sinks) | (key_slot >= query_slot - recent))
    return visible[None, None]


@memoised(64)
def causal_mask(q_len: int, k_len: int, device: torch.device) -> torch.Tensor:
    """(1, 1, q_len, k_len), True where the query at k_len - q_len + i may see key j (j <= that position). Memoised:
    forwards need the same few shapes in every layer (and block). Never modify the result."""
    rows = torch.arange(k_len - q_len, k_len, device=device).unsqueeze(-1)
    return (torch.arange(k_len, device=device) <= rows)[None, None]


@memoised(64)
def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool `mask` (True = attend) in additive form: 0 where visible, -inf elsewhere. Memoised by the mask object
    (the cache's masks are memoised: the layers of a forward share one, a layer with a budget of its own has its own,
    the same every forward); never modify the result."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def causal_additive_mask(q_len: int, k_len: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`causal_mask` in additive form: 0 where visible, -inf elsewhere (memoised through both; never modify it)."""
    return additive_mask(causal_mask(q_len, k_len, device), dtype)


def sink_queries(roller, query: torch.Tensor, cached: int, budget: int, sinks: int) -> torch.Tensor | None:
    """Queries as exact mode places them relative to the sinks, or None when that is where they already are.

    In exact mode a query never sits beyond slot `budget`, so a sink at slot s is budget - s away. In a chunk,
    query i sits at slot `cached` + i; for the sink columns it is moved back to min(cached + i, budget).
    """
    length = query.shape[-2]
    if not (roller is not None and sinks and length > 1 and cached + length - 1 > budget):
        return None
    raw = roller.unrotate(query, cached, cached + length)
    return roller.rotate_capped(raw, cached, cached + length, budget)


def layer_mean(received: torch.Tensor, q_heads: int) -> torch.Tensor:
    """Per-KV-head sums (batch, kv_heads, k_len) → the mean over all `q_heads` query heads of the layer, the same
    for every KV head (a policy that decides once per layer)."""
    return (received.sum(dim=1, keepdim=True) / q_heads).expand_as(received)
