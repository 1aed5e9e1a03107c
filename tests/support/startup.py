"""The command line's start-up: which modules `python -m h2o_stream ARGS` imports, and which of them are the heavy
libraries it must not load before click has parsed the command line."""

from __future__ import annotations

import os
import subprocess
import sys

#: what must not load before click has parsed the command line
HEAVY = ("torch", "transformers", "numba", "matplotlib", "ray", "datasets", "accelerate")


def imported_modules(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run `python -m h2o_stream ARGS` under -X importtime in an empty directory and environment of its own; its
    result and every module it imported."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HF_")}
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "h2o_stream", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    modules = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return done, modules


def heavy_in(modules: set[str]) -> list[str]:
    return sorted(name for name in modules if name.split(".")[0] in HEAVY)
