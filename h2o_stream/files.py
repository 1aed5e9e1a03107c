"""Writing files so that a reader never sees half of one: the one atomic writer every module uses."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path` in one step, on any error it is removed
    and `path` is left as it was.

    The temporary name keeps the target's suffix (`x.json` -> `x.json.<pid>.tmp.json`) so that writers which pick a
    format from the suffix (matplotlib) still do; it lives in the same directory, where `os.replace` is atomic.
    """
    target = Path(path)
    partial = target.with_name(f"{target.name}.{os.getpid()}.tmp{target.suffix}")
    try:
        yield partial
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):  # the original error matters, not a failed clean-up (read-only disk)
            partial.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, data) -> None:
    """`data` as indented JSON at `path`, atomically."""
    with atomic_path(path) as partial:
        with open(partial, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
