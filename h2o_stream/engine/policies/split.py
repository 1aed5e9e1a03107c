"""From a total cache size to a policy: shared validation, then the policy's own split (`from_budget`)."""

from __future__ import annotations

from h2o_stream.errors import H2OStreamError

from .base import EvictionPolicy, check_count
from .registry import declared_options, declared_parts, policy_class


def make_policy(name: str, cache_size: int | None = None, *, tokenizer=None, **parts) -> EvictionPolicy:
    """Build policy `name` for a budget of `cache_size` entries per layer and KV head, e.g.
    `make_policy("h2o", 256, heavy=64)` or `make_policy("a2sf", 256, alpha=0.9)`.

    `parts` are budget parts and settings by name (None = not given). The parts a policy does not take must be None
    or 0 (a setting it does not take must be None); those it takes win over its declared defaults (h2o: half heavy /
    half recent; sink: 4 sinks and the rest recent; window: all recent), and together they must add up to the cache
    size. `tokenizer` is the model's tokenizer, required by policies that derive settings from it (sepllm).
    """
    cls = policy_class(name)
    known = {**declared_parts(), **declared_options()}
    unknown = sorted(set(parts) - set(known))
    if unknown:
        raise H2OStreamError(
            f"no policy takes {', '.join(unknown)}; the parts are {', '.join(declared_parts())}"
            f" and the settings {', '.join(declared_options()) or 'none'}"
        )
    given = {label: value for label, value in parts.items() if value is not None}
    counts = {label: value for label, value in given.items() if label in declared_parts()}
    for label, value in counts.items():
        check_count(label, value)
    if cache_size is not None:
        check_count("cache size", cache_size, minimum=1)
        for label, value in counts.items():
            if value > cache_size:
                raise H2OStreamError(f"{label} ({value}) cannot exceed the cache size ({cache_size})")
    takes = (*cls.part_names(), *cls.option_names())
    unused = sorted(
        label for label, value in given.items() if label not in takes and (value or label not in declared_parts())
    )
    if unused:
        raise H2OStreamError(
            f"the {name} policy takes {', '.join(takes) or 'nothing but the cache size'}; "
            f"it does not take {', '.join(unused)}"
        )
    derived = {}
    if cls.needs_tokenizer:
        if tokenizer is None:
            raise H2OStreamError(
                f"the {name} policy needs the model's tokenizer (it reads token ids from it); "
                "pass tokenizer= to make_policy"
            )
        derived = cls.tokenizer_settings(tokenizer)
    policy = cls.from_budget(
        cache_size, **{label: value for label, value in given.items() if label in takes}, **derived
    )
    if cache_size is not None and policy.budget not in (None, cache_size):
        raise H2OStreamError(f"{policy.describe()} adds up to {policy.budget}, not the cache size {cache_size}")
    return policy
