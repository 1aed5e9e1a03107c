"""Package exports imported on first use (PEP 562), so that importing a package costs only what is used from it.

`h2o-stream --help` imports the packages on the way to the command line (h2o_stream, engine, apps...); with their
public names resolved on first access, it never imports torch or transformers, which take seconds to load.
"""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """(__getattr__, __dir__, __all__) for `package` whose public names are `exports`: module (absolute, or relative
    to `package` when it starts with '.') → the names it provides. A name is imported from its module when first
    asked for and then kept in the package like an ordinary attribute.

    A public name must not also be a submodule's name: importing that submodule would bind the module there."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(importlib.import_module(package)), *where})

    return __getattr__, __dir__, sorted(where)
