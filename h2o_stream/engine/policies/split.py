"""From a total cache size to a policy: shared validation, then the policy's own default split (`from_budget`)."""

from __future__ import annotations

from h2o_stream.errors import H2OStreamError
from .base import check_count
from .registry import policy_class


def make_policy(name: str, cache_size: int | None = None, *, heavy: int | None = None, recent: int | None = None,
                sinks: int | None = None):
    """Build policy `name` for a budget of `cache_size` entries per layer and KV head.

    Each policy's `from_budget` holds the papers' default split (h2o: half heavy / half recent; sink: 4 sinks and the
    rest recent; window: all recent). Parts given explicitly win; the parts must add up to the cache size.
    """
    cls = policy_class(name)
    parts = {"heavy": heavy, "recent": recent, "sinks": sinks}
    for label, value in parts.items():
        if value is not None:
            check_count(label, value)
    if cache_size is not None:
        check_count("cache size", cache_size, minimum=1)
        for label, value in parts.items():
            if value is not None and value > cache_size:
                raise H2OStreamError(f"{label} ({value}) cannot exceed the cache size ({cache_size})")
    unused = sorted(k for k, v in parts.items() if v and k not in cls.parts)
    if unused:
        takes = ", ".join(cls.parts) or "nothing but the cache size"
        raise H2OStreamError(f"the {name} policy takes {takes}; it does not take {', '.join(unused)}")
    policy = cls.from_budget(cache_size, **{k: parts[k] for k in cls.parts})
    if cache_size is not None and policy.budget not in (None, cache_size):
        raise H2OStreamError(f"{policy.describe()} adds up to {policy.budget}, not the cache size {cache_size}")
    return policy
