"""Shared bits for the benchmarks: threads, version stamp, atomic result files."""

from __future__ import annotations

import os
import platform
import sys

import torch
import transformers

from h2o_stream.apps.perplexity.report import write_json  # noqa: F401  (re-exported for the scripts)


def setup(threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)


def environment() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads(), "machine": platform.machine(),
            "command": "python " + " ".join(sys.argv),
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}


def save_figure(fig, path: str, title: str) -> None:
    import matplotlib.pyplot as plt

    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main_or_replot(main, plot) -> None:
    """`script.py --plot-only RESULT.json` redraws the PNG next to a result JSON; anything else runs the benchmark."""
    import json

    if len(sys.argv) == 3 and sys.argv[1] == "--plot-only":
        plot(json.loads(open(sys.argv[2]).read()), sys.argv[2].replace(".json", ".png"))
    else:
        main()
