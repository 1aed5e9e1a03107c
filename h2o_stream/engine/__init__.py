"""The engine: a fixed-budget KV cache for transformers models, the attention that feeds it, eviction policies, and
the loop that streams tokens through it. Imports nothing from the layers above (generation, loading, apps, cli)."""

from .cache import StreamingCache, StreamingLayer
from .feed import chunks, feed
from .hooks import attach
from .policies import POLICIES, EvictionPolicy, make_policy, policy_class, register

__all__ = ["POLICIES", "EvictionPolicy", "StreamingCache", "StreamingLayer", "attach", "chunks", "feed", "make_policy",
           "policy_class", "register"]
