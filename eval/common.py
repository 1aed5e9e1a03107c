"""Shared bits for the benchmarks: threads, version stamp, atomic result files."""

from __future__ import annotations

import platform
import sys

import torch
import transformers

from h2o_stream.report import write_json  # noqa: F401  (re-exported for the scripts)


def setup(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def environment() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "command": "python " + " ".join(sys.argv)}
