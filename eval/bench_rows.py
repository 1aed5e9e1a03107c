"""Batched sweep rows (`ppl --rows`): a sweep's runs as the rows of one batch against the same runs one after another.

On the default model, the sweep (default: h2o, sink, tova and a2sf at cache 256, each at its default fair chunk, in
forwards of 256) is fed the corpus' first --tokens tokens twice per round, alternating: as rows of one batch
(`RunRows`) and run by run. Reports the sweep's tokens per second (runs x tokens / seconds of feeding, model load
excluded), median over rounds, and how far each run's per-token NLL is from the same run alone.

    python eval/bench_rows.py --data /path/to/corpus.jsonl --out eval/results/bench_rows.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import corpus_tokens, data_option, environment, main_or_replot, new_figure, paired_bars, save_figure, setup
from common import write_json

from h2o_stream import make_policy
from h2o_stream.apps.perplexity.rows import RunRows
from h2o_stream.apps.perplexity.run import PerplexityRun, token_pieces
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--policies", default="h2o,sink,tova,a2sf", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--tokens", default=4096, show_default=True, help="Stream tokens per run.")
@click.option("--threads", default="1", show_default=True, help="Thread counts, comma-separated.")
@click.option("--rounds", default=2, show_default=True)
@data_option
@click.option("--out", default="eval/results/bench_rows.json", show_default=True)
def main(policies, cache_size, tokens, threads, rounds, data, out):
    loaded = load_model(None)
    stream = corpus_tokens(loaded.tokenizer, tokens, data)
    names = policies.split(",")

    def runs():
        return [PerplexityRun(loaded.model, make_policy(name, cache_size, tokenizer=loaded.tokenizer),
                              record_tokens=True) for name in names]

    seconds, gaps = {}, {}
    for count in (int(t) for t in threads.split(",")):
        setup(count)
        seconds[count] = {"rows": [], "one after another": []}
        for round_ in range(rounds):
            made = {}
            for way in ("rows", "one after another")[::1 if round_ % 2 == 0 else -1]:  # who goes first alternates
                made[way] = runs()
                started = time.perf_counter()
                if way == "rows":
                    RunRows(made[way]).run(token_pieces(stream))
                else:
                    for run in made[way]:
                        run.run(token_pieces(stream))
                seconds[count][way].append(time.perf_counter() - started)
            print(f"{count} thread(s): rows {seconds[count]['rows'][-1]:.1f} s, one after another "
                  f"{seconds[count]['one after another'][-1]:.1f} s", flush=True)
            gaps = {name: (torch.cat(a.token_nll) - torch.cat(b.token_nll)).abs().mean().item()
                    for name, a, b in zip(names, made["rows"], made["one after another"])}
    speed = {count: {way: len(names) * tokens / statistics.median(v) for way, v in ways.items()}
             for count, ways in seconds.items()}
    report = {"benchmark": "batched sweep rows vs runs one after another", "model": loaded.name,
              "policies": names, "cache_size": cache_size, "tokens_per_run": tokens, "data": data,
              "environment": environment(), "seconds": seconds, "sweep_tokens_per_second": speed,
              "rows_vs_one_after_another": {c: s["rows"] / s["one after another"] for c, s in speed.items()},
              "mean_abs_token_nll_difference": gaps}
    for count, ways in speed.items():
        print(f"{count} thread(s): rows {ways['rows']:.0f} tok/s, one after another "
              f"{ways['one after another']:.0f} tok/s ({ways['rows'] / ways['one after another']:.2f}x)")
    print("mean |per-token NLL difference| rows vs alone:", {k: f"{v:.1e}" for k, v in gaps.items()})
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    speed = report["sweep_tokens_per_second"]
    fig, ax = new_figure(1, 1, size=(5, 3.2))
    paired_bars(ax, {f"{count} thread(s)": ways for count, ways in speed.items()}, ("rows", "one after another"),
                "sweep tokens / second")
    save_figure(fig, path, f"{len(report['policies'])} runs ({', '.join(report['policies'])}) at cache "
                           f"{report['cache_size']}, {report['tokens_per_run']:,} tokens each")


if __name__ == "__main__":
    main_or_replot(main, plot)
