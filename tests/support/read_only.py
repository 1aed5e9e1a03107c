"""A place this process cannot create files in, whoever runs the tests: root ignores permission bits, so the tests of
a read-only place that CI (root) runs as well take a place that refuses even root."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def read_only_directory(tmp_path: Path) -> tuple[Path, str]:
    """A directory nothing can be written into, and the reason the system gives (its strerror): one with its write
    bits off where they hold (not for root); else /sys/kernel (sysfs refuses even root: "Permission denied"); else
    /proc (no file can be made there: "No such file or directory"). Each is tried with a real write."""
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    for place in (locked, Path("/sys/kernel"), Path("/proc")):
        try:
            handle, name = tempfile.mkstemp(dir=place)
        except OSError as error:
            return place, error.strerror
        os.close(handle)
        os.unlink(name)
    raise AssertionError("no directory here refuses this process's writes, not even /sys/kernel or /proc")
