"""The engine: a fixed-budget KV cache for transformers models, the attention that feeds it, eviction policies, and
the loop that streams tokens through it. Imports nothing from the layers above (generation, loading, apps, cli)."""

from .cache import StreamingCache, StreamingLayer, default_chunk_size
from .feed import chunks, feed
from .hooks import attach
from .rows import RowsCache
from .policies import POLICIES, EvictionPolicy, Part, declared_parts, make_policy, policy_class, register

__all__ = ["POLICIES", "EvictionPolicy", "Part", "RowsCache", "StreamingCache", "StreamingLayer", "attach", "chunks",
           "declared_parts", "default_chunk_size", "feed", "make_policy", "policy_class", "register"]
