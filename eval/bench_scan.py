"""Scanned forwards vs one forward per decision, on the default model and a corpus, side by side in one run.

For each policy and decision size (1 = exact mode; a fair chunk), the same stream is fed two ways from the same full
cache: one model forward per decision, and scanned (`StreamingCache(decide_every=k)`, forwards of --span tokens that
decide every k tokens inside each layer; the same results, tests/test_scan.py). Contenders without cache logic at the
same span: the model's raw forward of --span tokens over a DynamicCache of B entries (cropped back after each forward)
and its raw decode step (one token over B entries). Rounds alternate between contenders, at each thread count.

    python eval/bench_scan.py --data /path/to/corpus.jsonl --out eval/results/bench_scan.json
"""

from __future__ import annotations

import statistics

import click
import torch
from common import corpus_tokens, data_option, environment, main_or_replot, new_figure, race, save_figure
from common import write_json
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import default_chunk_size
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--span", default=256, show_default=True, help="Tokens per scanned (and raw) forward.")
@click.option("--policies", default="h2o,tova,sink", show_default=True)
@click.option("--threads", default="1,2", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--tokens", default=512, show_default=True, help="Tokens per timed round for the wide contenders.")
@click.option("--step-tokens", default=32, show_default=True,
              help="Tokens per timed round for one forward per token (exact mode unscanned, raw decode).")
@data_option
@click.option("--out", default="eval/results/bench_scan.json", show_default=True)
def main(cache_size, span, policies, threads, rounds, tokens, step_tokens, data, out):
    torch.manual_seed(0)
    loaded = load_model(None)
    model = loaded.model
    stream = corpus_tokens(loaded.tokenizer, cache_size + rounds * tokens, data)
    prefix, timed = stream[:cache_size], stream[cache_size:]
    contenders = {}  # name: (make cache, tokens per forward, crop, tokens per round)
    contenders["raw forward"] = (lambda: DynamicCache(config=model.config), span, True, tokens)
    contenders["raw decode step"] = (lambda: DynamicCache(config=model.config), 1, True, step_tokens)
    for name in policies.split(","):
        policy = make_policy(name, cache_size)
        for step in sorted({1, default_chunk_size(policy)}):
            width = min(span, max(step, default_chunk_size(policy)))
            if policy.band() is not None:  # exact at any forward width: only its default forward
                if step == 1:
                    continue
                contenders[f"{name} chunk {width}"] = (lambda p=policy: StreamingCache(model, p), width, False, tokens)
                continue
            label = "exact" if step == 1 else f"chunk {step}"
            contenders[f"{name} {label}, one forward each"] = (
                lambda p=policy: StreamingCache(model, p), step, False, step_tokens if step == 1 else tokens // 2)
            contenders[f"{name} {label}, scanned in {span}"] = (
                lambda p=policy, k=step: StreamingCache(model, p, decide_every=k), span, False, tokens)
    report = {"benchmark": "scanned forwards vs one forward per decision", "model": loaded.name, "data": data,
              "cache_size": cache_size, "span": span, "environment": environment(), "threads": {}}
    for count in [int(t) for t in threads.split(",")]:
        torch.set_num_threads(count)
        seconds = race(model, contenders, prefix, timed, rounds, tokens)
        speed = {name: 1 / statistics.median(v) for name, v in seconds.items()}
        report["threads"][str(count)] = {"tokens_per_second": speed,
                                         "vs_raw_forward": {n: s / speed["raw forward"] for n, s in speed.items()},
                                         "vs_raw_decode_step": {n: s / speed["raw decode step"]
                                                                for n, s in speed.items()}}
        for name, value in speed.items():
            print(f"{count} thread(s)  {name:38s} {value:7.1f} tok/s  {value / speed['raw forward']:.2f}x raw "
                  f"forward  {value / speed['raw decode step']:.1f}x raw decode step", flush=True)
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    counts = list(report["threads"])
    fig, axes = new_figure(1, len(counts), size=(6 * len(counts), 4.2))
    axes = axes if len(counts) > 1 else [axes]
    for ax, count in zip(axes, counts):
        speed = report["threads"][count]["tokens_per_second"]
        names = list(speed)
        ax.barh(names, [speed[n] for n in names], color=["#888888" if n.startswith("raw") else "#4c72b0"
                                                         for n in names])
        ax.invert_yaxis()
        ax.set_xlabel("tokens / second")
        ax.set_title(f"{count} thread(s)", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, scanned forwards of {report['span']}")


if __name__ == "__main__":
    main_or_replot(main, plot)
