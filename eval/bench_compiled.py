"""Exact mode compiled (engine/compiled.py) against the same steps on tensor operations and the raw forwards, side by
side in one run on the default model and a corpus.

For each policy: exact mode scanned in forwards of --span tokens (`ppl --exact`, and tova's default) and one forward
per token (decoding), each on the compiled loop and on tensor operations (H2O_STREAM_COMPILED=0 for its rounds); the
policy's default fair chunk (scanned, tensor operations) where it is not exact mode. Without cache logic: the model's
raw forward of --span tokens over a DynamicCache of B entries and its raw decode step over B entries (cropped back
after each forward), the decode step also under `torch.inference_mode` (as h2o-stream runs its forwards with
gradients off: like for like). Rounds alternate between contenders, at each thread count.

    python eval/bench_compiled.py --data /path/to/corpus.jsonl --out eval/results/compiled/bench_compiled.json
"""

from __future__ import annotations

import contextlib
import os
import statistics

import click
import matplotlib.ticker
import torch
from common import corpus_tokens, data_option, environment, main_or_replot, new_figure, race, save_figure
from common import write_json
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import default_chunk_size
from h2o_stream.loading.models import load_model

TENSOR_OPS = ", tensor ops"


@click.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--span", default=256, show_default=True, help="Tokens per scanned (and raw) forward.")
@click.option("--policies", default="h2o,tova,roco,sink", show_default=True)
@click.option("--threads", default="1,2", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--tokens", default=512, show_default=True, help="Tokens per timed round for the wide contenders.")
@click.option("--step-tokens", default=32, show_default=True, help="Tokens per timed round, one forward per token.")
@data_option
@click.option("--out", default="eval/results/compiled/bench_compiled.json", show_default=True)
def main(cache_size, span, policies, threads, rounds, tokens, step_tokens, data, out):
    torch.manual_seed(0)
    loaded = load_model(None)
    model = loaded.model
    stream = corpus_tokens(loaded.tokenizer, cache_size + rounds * tokens, data)
    prefix, timed = stream[:cache_size], stream[cache_size:]
    raw = lambda: DynamicCache(config=model.config)  # noqa: E731
    # name: (make cache, tokens per forward, raw (cropped back), tokens per round)
    contenders = {"raw forward": (raw, span, True, tokens), "raw decode step": (raw, 1, True, step_tokens),
                  "raw decode step, inference mode": (raw, 1, True, step_tokens)}
    for name in policies.split(","):
        policy = make_policy(name, cache_size)
        chunk = default_chunk_size(policy)
        if policy.band() is not None:  # exact at any width: its chunk, and decoding
            contenders[f"{name} chunk {chunk}"] = (lambda p=policy: StreamingCache(model, p), chunk, False, tokens)
        else:
            for ops in ("", TENSOR_OPS):
                contenders[f"{name} exact, scanned in {span}{ops}"] = (
                    lambda p=policy: StreamingCache(model, p, decide_every=1), span, False, tokens)
            if chunk > 1:
                contenders[f"{name} chunk {chunk}, scanned in {span}"] = (
                    lambda p=policy, k=chunk: StreamingCache(model, p, decide_every=k), span, False, tokens)
        for ops in ("", TENSOR_OPS):
            contenders[f"{name} exact, one forward each{ops}"] = (
                lambda p=policy: StreamingCache(model, p), 1, False, step_tokens)
    report = {"benchmark": "exact mode compiled vs on tensor operations vs raw forwards", "model": loaded.name,
              "data": data, "cache_size": cache_size, "span": span, "environment": environment(), "threads": {}}
    for count in [int(t) for t in threads.split(",")]:
        torch.set_num_threads(count)
        seconds = race(model, contenders, prefix, timed, rounds, tokens, context=_context)
        speed = {name: 1 / statistics.median(v) for name, v in seconds.items()}
        report["threads"][str(count)] = {
            "tokens_per_second": speed, "seconds_per_token_per_round": seconds,
            "vs_raw_forward": {n: s / speed["raw forward"] for n, s in speed.items()},
            "vs_raw_decode_step": {n: s / speed["raw decode step"] for n, s in speed.items()},
            "vs_raw_decode_step_in_inference_mode": {n: s / speed["raw decode step, inference mode"]
                                                     for n, s in speed.items()}}
        for name, value in speed.items():
            print(f"{count} thread(s)  {name:45s} {value:7.1f} tok/s  {value / speed['raw forward']:.2f}x raw "
                  f"forward  {value / speed['raw decode step']:.2f}x raw decode step "
                  f"({value / speed['raw decode step, inference mode']:.2f}x in inference mode)", flush=True)
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


@contextlib.contextmanager
def _context(name: str):
    """A contender's round: the compiled loop off for the tensor-operation ones, the raw step's twin in inference
    mode."""
    os.environ["H2O_STREAM_COMPILED"] = "0" if name.endswith(TENSOR_OPS) else "1"
    try:
        with torch.inference_mode() if name.endswith("inference mode") else contextlib.nullcontext():
            yield
    finally:
        os.environ.pop("H2O_STREAM_COMPILED")


def plot(report: dict, path: str) -> None:
    counts = list(report["threads"])
    fig, axes = new_figure(1, len(counts), size=(6.5 * len(counts), 5))
    axes = axes if len(counts) > 1 else [axes]
    for ax, count in zip(axes, counts):
        speed = report["threads"][count]["tokens_per_second"]
        names = list(speed)
        ax.barh(names, [speed[n] for n in names], color=[_color(n) for n in names])
        for i, n in enumerate(names):
            ax.text(speed[n], i, f" {speed[n]:.0f}", va="center", fontsize=6)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.invert_yaxis()
        ax.set_xlabel("tokens / second (log scale)")
        ax.set_title(f"{count} thread(s)", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, forwards of {report['span']}\nblue: "
                           "exact mode compiled, orange: exact mode on tensor operations, green: chunks, grey: raw")


def _color(name: str) -> str:
    if name.startswith("raw"):
        return "#888888"
    if name.endswith(TENSOR_OPS):
        return "#dd8452"
    return "#55a868" if " chunk " in name else "#4c72b0"


if __name__ == "__main__":
    main_or_replot(main, plot)
