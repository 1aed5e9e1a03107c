"""How to spend a machine's cores on a sweep: one process with all threads, or one single-thread worker per core.

Runs the same `h2o-stream ppl` sweep (default: h2o and sink at cache 256 on the corpus' first --tokens tokens) as
subprocesses with each --workers/--threads layout, alternating layouts over --rounds, and reports the sweep's
tokens per second of wall time (model loading included), median over rounds.

    python eval/bench_workers.py --data /path/to/corpus.jsonl --out eval/results/bench_workers.json
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

import click
from common import data_option, environment, main_or_replot, new_figure, save_figure, write_json


@click.command()
@click.option("--policies", default="h2o,sink", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--tokens", default=20_000, show_default=True, help="Stream tokens per run.")
@click.option("--layouts", default="1x2,2x1", show_default=True, help="WORKERSxTHREADS, comma-separated.")
@click.option("--rounds", default=2, show_default=True)
@data_option
@click.option("--out", default="eval/results/bench_workers.json", show_default=True)
def main(policies, cache_size, tokens, layouts, rounds, data, out):
    layouts = [tuple(int(x) for x in layout.split("x")) for layout in layouts.split(",")]
    runs = len(policies.split(","))
    seconds = {f"{w}x{t}": [] for w, t in layouts}
    for _ in range(rounds):
        for workers, threads in layouts:
            with tempfile.TemporaryDirectory() as scratch:
                command = [sys.executable, "-m", "h2o_stream", "ppl", "--data", data, "--policy", policies,
                           "--cache-size", str(cache_size), "--tokens", str(tokens), "--workers", str(workers),
                           "--threads", str(threads), "--out", os.path.join(scratch, "out")]
                started = time.perf_counter()
                subprocess.run(command, check=True, capture_output=True, env={**os.environ, "TQDM_DISABLE": "1"})
                seconds[f"{workers}x{threads}"].append(time.perf_counter() - started)
            print(f"{workers} worker(s) x {threads} thread(s): {seconds[f'{workers}x{threads}'][-1]:.1f} s",
                  flush=True)
    speed = {layout: runs * tokens / statistics.median(v) for layout, v in seconds.items()}
    report = {"benchmark": "sweep layouts: workers x threads", "policies": policies, "cache_size": cache_size,
              "tokens_per_run": tokens, "runs": runs, "cpu_count": os.cpu_count(), "data": data,
              "environment": environment(), "seconds": seconds, "sweep_tokens_per_second": speed}
    for layout, value in speed.items():
        print(f"{layout}: {value:.0f} tok/s over the sweep")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    speed = report["sweep_tokens_per_second"]
    fig, ax = new_figure(1, 1, size=(4.5, 3.2))
    ax.bar([f"{k.split('x')[0]} worker(s)\nx {k.split('x')[1]} thread(s)" for k in speed], list(speed.values()),
           color="#4c72b0")
    ax.set_ylabel("sweep tokens / second (wall)")
    save_figure(fig, path, f"{report['policies']} at cache {report['cache_size']}, {report['tokens_per_run']:,} "
                           f"tokens each, {report['cpu_count']} cores")


if __name__ == "__main__":
    main_or_replot(main, plot)
