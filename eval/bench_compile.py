"""Past eager transformers: the default model's raw chunked forward, eager against torch.compile (inductor).

A plain forward of --span tokens (no cache, no h2o-stream code: the ceiling of what a compiled model could give
`ppl`), timed in alternating rounds per thread count after the compiled model's first call (its compile time is
reported separately).

    python eval/bench_compile.py --out eval/results/bench_compile.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import environment, main_or_replot, new_figure, paired_bars, save_figure, setup, write_json

from h2o_stream.loading.models import load_model


@click.command()
@click.option("--span", default=256, show_default=True)
@click.option("--threads", default="1,2", show_default=True)
@click.option("--rounds", default=6, show_default=True)
@click.option("--out", default="eval/results/bench_compile.json", show_default=True)
def main(span, threads, rounds, out):
    loaded = load_model(None)
    model = loaded.model
    ids = torch.randint(100, model.config.vocab_size - 100, (1, span), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, dynamic=False)
    forwards = {"eager": model, "compiled": compiled}
    speed, compile_seconds = {}, {}
    with torch.no_grad():
        for count in (int(t) for t in threads.split(",")):
            setup(count)
            started = time.perf_counter()
            compiled(ids, use_cache=False)  # compiles (first thread count) or warms up
            compile_seconds[count] = time.perf_counter() - started
            model(ids, use_cache=False)
            seconds = {name: [] for name in forwards}
            for _ in range(rounds):
                for name, forward in forwards.items():
                    started = time.perf_counter()
                    forward(ids, use_cache=False)
                    seconds[name].append(time.perf_counter() - started)
            speed[count] = {name: span / statistics.median(v) for name, v in seconds.items()}
            print(f"{count} thread(s): eager {speed[count]['eager']:.0f} tok/s, compiled "
                  f"{speed[count]['compiled']:.0f} tok/s (first call {compile_seconds[count]:.0f} s)", flush=True)
    report = {"benchmark": "raw forward, eager vs torch.compile (inductor)", "model": loaded.name, "span": span,
              "rounds": rounds, "environment": environment(), "tokens_per_second": speed,
              "compiled_vs_eager": {c: s["compiled"] / s["eager"] for c, s in speed.items()},
              "first_call_seconds": compile_seconds}
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    speed = report["tokens_per_second"]
    fig, ax = new_figure(1, 1, size=(4.5, 3.2))
    paired_bars(ax, {f"{count} thread(s)": s for count, s in speed.items()}, ("eager", "compiled"), "tokens / second")
    save_figure(fig, path, f"raw {report['span']}-token forward, eager vs torch.compile")


if __name__ == "__main__":
    main_or_replot(main, plot)
