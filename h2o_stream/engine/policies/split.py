"""From a total cache size to a policy: shared validation, then the policy's own split (`from_budget`)."""

from __future__ import annotations

from h2o_stream.errors import H2OStreamError
from .base import EvictionPolicy, check_count
from .registry import declared_parts, policy_class


def make_policy(name: str, cache_size: int | None = None, **parts: int | None) -> EvictionPolicy:
    """Build policy `name` for a budget of `cache_size` entries per layer and KV head, e.g.
    `make_policy("h2o", 256, heavy=64)`.

    `parts` are budget parts by name (None = not given). The parts a policy does not take must be None or 0; those it
    takes win over its declared defaults (h2o: half heavy / half recent; sink: 4 sinks and the rest recent; window:
    all recent), and together they must add up to the cache size.
    """
    cls = policy_class(name)
    unknown = sorted(set(parts) - set(declared_parts()))
    if unknown:
        raise H2OStreamError(f"no policy takes {', '.join(unknown)}; the parts are {', '.join(declared_parts())}")
    given = {label: value for label, value in parts.items() if value is not None}
    for label, value in given.items():
        check_count(label, value)
    if cache_size is not None:
        check_count("cache size", cache_size, minimum=1)
        for label, value in given.items():
            if value > cache_size:
                raise H2OStreamError(f"{label} ({value}) cannot exceed the cache size ({cache_size})")
    takes = cls.part_names()
    unused = sorted(label for label, value in given.items() if value and label not in takes)
    if unused:
        raise H2OStreamError(f"the {name} policy takes {', '.join(takes) or 'nothing but the cache size'}; "
                             f"it does not take {', '.join(unused)}")
    policy = cls.from_budget(cache_size, **{label: value for label, value in given.items() if label in takes})
    if cache_size is not None and policy.budget not in (None, cache_size):
        raise H2OStreamError(f"{policy.describe()} adds up to {policy.budget}, not the cache size {cache_size}")
    return policy
