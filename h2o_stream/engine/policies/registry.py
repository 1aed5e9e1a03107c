"""Policy names → classes. A new policy is one file with `@register` on its class, plus its import in __init__."""

from __future__ import annotations

from h2o_stream.errors import H2OStreamError

POLICIES: dict[str, type] = {}


def register(cls):
    POLICIES[cls.name] = cls
    return cls


def policy_class(name: str) -> type:
    try:
        return POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise H2OStreamError(f"unknown policy {name!r}; choose one of: {known}") from None
