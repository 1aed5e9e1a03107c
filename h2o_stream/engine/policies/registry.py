"""Policy names → classes. A new policy is one file in this folder with `@register` on its class (the package imports
every module of the folder)."""

from __future__ import annotations

import dataclasses

from h2o_stream.errors import H2OStreamError

from .base import EvictionPolicy, Part, Setting

POLICIES: dict[str, type[EvictionPolicy]] = {}


def register(cls: type[EvictionPolicy]) -> type[EvictionPolicy]:
    """Class decorator (above @dataclass): make `cls` available by `cls.name` (to make_policy, the command line and
    the results)."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise H2OStreamError(f"{cls.__qualname__} needs a class attribute `name` to be registered")
    names = cls.part_names()
    if len(set(names)) != len(names) or sum(part.is_rest for part in cls.parts) > 1:
        raise H2OStreamError(f"{cls.__qualname__}.parts needs distinct names and at most one rest part")
    if set(cls.option_names()) & set(names):  # (two settings of one name are one field: `field_settings`)
        raise H2OStreamError(f"{cls.__qualname__}'s settings need names none of its parts has")
    # the settings were read from the class body (`field_settings`); only a dataclass makes them constructor arguments
    fields = {field.name: field.default for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    if any(fields.get(option.name, dataclasses.MISSING) != option.default for option in cls.options):
        raise H2OStreamError(f"{cls.__qualname__} needs @dataclass below @register: its settings are its fields")
    known = POLICIES.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise H2OStreamError(f"policy name {name!r} is taken by {known.__module__}.{known.__qualname__}")
    POLICIES[name] = cls
    return cls


def policy_class(name: str) -> type[EvictionPolicy]:
    """The registered class called `name`, or an H2OStreamError listing the known names."""
    try:
        return POLICIES[name]
    except KeyError:
        known = ", ".join(sorted(POLICIES))
        raise H2OStreamError(f"unknown policy {name!r}; choose one of: {known}") from None


def declared_parts() -> dict[str, list[tuple[str, Part]]]:
    """Every budget part any registered policy takes: part name → [(policy name, its declaration)], in registry
    order. The command line makes one option per part from this."""
    parts: dict[str, list[tuple[str, Part]]] = {}
    for name, cls in POLICIES.items():
        for part in cls.parts:
            parts.setdefault(part.name, []).append((name, part))
    return parts


def declared_options() -> dict[str, list[tuple[str, Setting]]]:
    """Every setting (not a slot count) any registered policy takes: setting name → [(policy name, its
    declaration)], in registry order; the counterpart of `declared_parts` for options such as a2sf's `alpha`."""
    options: dict[str, list[tuple[str, Setting]]] = {}
    for name, cls in POLICIES.items():
        for option in cls.options:
            options.setdefault(option.name, []).append((name, option))
    return options
