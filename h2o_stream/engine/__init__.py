"""The engine: a fixed-budget KV cache for transformers models, the attention that feeds it, eviction policies, and
the loop that streams tokens through it. Imports nothing from the layers above (generation, loading, apps, cli).


Its names are imported on first use (`h2o_stream.lazy`): the policy registry, read by the command line's options,
loads without torch. `feed` is the module h2o_stream.engine.feed (the function: h2o_stream.engine.feed.feed).
"""

from h2o_stream.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".cache": ("StreamingCache", "StreamingLayer", "default_chunk_size"),
        ".feed": ("chunks",),
        ".hooks": ("attach",),
        ".rows": ("RowsCache",),
        ".policies": (
            "POLICIES",
            "EvictionPolicy",
            "Part",
            "declared_parts",
            "make_policy",
            "policy_class",
            "register",
        ),
    },
)
