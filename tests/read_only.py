"""A place this process cannot create files in, whoever runs the tests: root ignores permission bits, so the tests of
a read-only place that CI (root) runs as well take a place that refuses even root."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path


def read_only_directory(tmp_path: Path) -> tuple[Path, str]:
    """A directory nothing can be written into, and the reason the system gives (its strerror): one with its write
    bits off where they hold (not for root); else /sys/kernel (sysfs refuses even root: "Permission denied"); else a
    path under a regular file ("Not a directory"). Each is tried with a real write."""
    locked = tmp_path / "read-only"
    locked.mkdir()
    locked.chmod(0o555)
    for place in (locked, Path("/sys/kernel")):
        try:
            handle, name = tempfile.mkstemp(dir=place)
        except OSError as error:
            return place, error.strerror
        os.close(handle)
        os.unlink(name)
    locked.chmod(0o755)
    (tmp_path / "a-file").write_text("a file, not a directory")
    return tmp_path / "a-file" / "directory", os.strerror(errno.ENOTDIR)
