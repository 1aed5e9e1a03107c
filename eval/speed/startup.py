"""`python -m eval speed startup`: seconds from launch to exit of the CLI's help and a bad option (or of a short
`ppl` on a model), fresh processes in alternating rounds."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from eval.common import (
    BadInput,
    alternate,
    environment,
    new_figure,
    save_figure,
    speed_out_dir_option,
    write_result,
)

STARTUP = (("--help",), ("ppl", "--help"), ("ppl", "--nope"))


@click.command()
@click.option("--rounds", default=10, show_default=True)
@click.option(
    "--model",
    "model_spec",
    default=None,
    help="Time instead a short `ppl` on this model, launch to exit (run it once before: its later starts).",
)
@speed_out_dir_option
def startup(rounds, model_spec, out_dir):
    """Seconds from launch to exit of the CLI's help and a bad option, fresh processes: startup.json (with --model,
    of a 16-token `ppl` on that model: startup_MODEL.json)."""
    program = shutil.which("h2o-stream", path=str(Path(sys.executable).parent)) or shutil.which("h2o-stream")
    if program is None:
        raise BadInput("no h2o-stream command on PATH: install the package (pip install -e .)")
    commands = (
        STARTUP
        if model_spec is None
        else (("ppl", "--model", model_spec, "--data", "sample", "--policy", "sink", "--tokens", "16", "--out", "OUT"),)
    )
    statuses = {}
    load = os.getloadavg()  # on a shared machine, what else was running

    def step(arguments):
        def run(_r, _i):
            with tempfile.TemporaryDirectory(prefix="h2o-stream-startup-") as work:  # a fresh --out every time
                started = time.perf_counter()
                done = subprocess.run(
                    [program, *(str(Path(work) / "out") if a == "OUT" else a for a in arguments)], capture_output=True
                )
                statuses[arguments] = done.returncode
                return time.perf_counter() - started

        return run

    seconds = alternate({arguments: step(arguments) for arguments in commands}, rounds)
    commands = {
        " ".join(("h2o-stream", *a)): {
            "median_seconds": statistics.median(v),
            "max_seconds": max(v),
            "seconds": v,
            "exit_status": statuses[a],
        }
        for a, v in seconds.items()
    }
    print(
        {
            command: f"median {row['median_seconds']:.3f} s, max {row['max_seconds']:.3f} s"
            for command, row in commands.items()
        }
    )
    report = {
        "benchmark": "CLI start-up: fresh processes, launch to exit",
        "rounds": rounds,
        "environment": environment(),
        "cpus": os.cpu_count(),
        "load_average_at_start": list(load),
        "commands": commands,
    }
    if model_spec is not None:
        report["model"] = model_spec
    name = "startup.json" if model_spec is None else f"startup_{Path(model_spec).name}.json"
    write_result(out_dir / name, report, plot_startup)


def plot_startup(report: dict, path: Path) -> None:
    rows = report["commands"]
    fig, ax = new_figure(size=(6, 3))
    ax.barh(list(rows), [r["median_seconds"] for r in rows.values()], color="#4c72b0", label="median")
    ax.scatter([r["max_seconds"] for r in rows.values()], range(len(rows)), color="red", marker="|", s=200, label="max")
    ax.invert_yaxis()
    ax.set_xlabel("seconds, launch to exit")
    ax.legend(fontsize=8, loc="lower right")
    save_figure(fig, path, f"CLI start-up over {report['rounds']} rounds")
