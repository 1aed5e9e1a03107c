"""Exact (token-by-token) mode and chat generation vs transformers' DynamicCache decode at the same cache length.

All decode one token per forward over a cache of `--cache-size` entries on the default model. `chat` is the chat's
decode loop (`generation.generate` with the chat's default sampling, repetition controls included, and text
streaming) over an h2o cache: everything a chat reply costs per token besides reading the prompt. Blocks of
`--block` timed steps alternate between the contenders (the machine is noisy; alternation spreads the noise evenly).
The DynamicCache is cropped back to exactly cache-size tokens after each of its blocks, so it attends over
cache-size+1..cache-size+block keys; ours over cache-size+1 every step.

`dynamic` runs under `torch.no_grad`, as `model.generate` does; h2o-stream's forwards then run under
`torch.inference_mode` (its hooks enter it whenever gradients are off). `dynamic_inference`, the same raw decode step
under `torch.inference_mode`, is the like-for-like baseline; ratios are given against both.

    python eval/bench_exact.py --threads 2 --out eval/results/bench_exact.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import environment, main_or_replot, new_figure, save_figure, setup, write_json
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.apps.chat import chat_sampling
from h2o_stream.generation import generate
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--block", default=16, show_default=True, help="Timed decode steps per block.")
@click.option("--rounds", default=8, show_default=True, help="Blocks per contender.")
@click.option("--policies", default="h2o,sink,window,full,chat", show_default=True,
              help="Contenders besides the DynamicCache; chat is the chat's decode loop over an h2o cache.")
@click.option("--threads", default=2, show_default=True)
@click.option("--out", default="eval/results/bench_exact.json", show_default=True)
def main(cache_size, block, rounds, policies, threads, out):
    setup(threads)
    loaded = load_model(None)
    model = loaded.model
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(100, model.config.vocab_size - 100, (1, cache_size + rounds * block + 1),
                           generator=generator)
    raw = ["dynamic", "dynamic_inference"]
    names = raw + policies.split(",")
    caches = {}
    for name in names:
        if name in raw:
            caches[name] = DynamicCache(config=model.config)
        else:
            budget = None if name == "full" else cache_size
            caches[name] = StreamingCache(model, make_policy("h2o" if name == "chat" else name, budget))
        with torch.no_grad():
            model(stream[:, :cache_size], cache=caches[name])
    per_token = {name: [] for name in names}
    sampling = chat_sampling()
    with torch.no_grad():
        for r in range(rounds):
            for name in names:
                cache = caches[name]
                if name == "full":  # keep full at the same length too: refill
                    cache = caches[name] = StreamingCache(model, make_policy("full"))
                    model(stream[:, :cache_size], cache=cache)
                steps = stream[:, cache_size + r * block: cache_size + (r + 1) * block]
                started = time.perf_counter()
                if name == "chat":  # block + 1 tokens picked, block of them fed (the last one's logits unneeded)
                    logits = model(steps[:, :1], cache=cache).logits[0, -1]
                    reply = generate(model, loaded.tokenizer, cache, logits, sampling, stop_ids=(),
                                     max_new_tokens=block)
                    assert reply.fed == block - 1
                elif name == "dynamic_inference":
                    with torch.inference_mode():
                        for i in range(block):
                            model(steps[:, i:i + 1], cache=cache)
                else:
                    for i in range(block):
                        model(steps[:, i:i + 1], cache=cache)
                per_token[name].append((time.perf_counter() - started) / block)
                if name in raw:
                    cache.crop(-block)
    median = {name: statistics.median(v) for name, v in per_token.items()}
    ratios = {name: median[name] / median["dynamic"] for name in names[1:]}
    like_for_like = {name: median[name] / median["dynamic_inference"] for name in names[len(raw):]}
    for name in names:
        extra = f"  time vs DynamicCache {ratios[name]:.3f}x" if name in ratios else ""
        if name in like_for_like:
            extra += f", vs it under inference mode {like_for_like[name]:.3f}x"
        print(f"{name:8s} {median[name] * 1000:7.2f} ms/token{extra}")
    report = {"benchmark": "exact-mode decode vs DynamicCache", "model": loaded.name,
              "cache_size": cache_size, "block": block, "rounds": rounds, "environment": environment(),
              "median_seconds_per_token": median, "ratio_vs_dynamic": ratios,
              "ratio_vs_dynamic_inference": like_for_like,
              "per_block_seconds_per_token": per_token, "target_ratio": 1 / 0.9}
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    names = list(report["median_seconds_per_token"])
    fig, ax = new_figure(size=(6, 3.4))
    ax.bar(names, [1000 * report["median_seconds_per_token"][n] for n in names], color="#4c72b0")
    like = report.get("ratio_vs_dynamic_inference", {})
    for i, n in enumerate(names[1:], start=1):
        label = f"{report['ratio_vs_dynamic'][n]:.2f}x" + (f"\n{like[n]:.2f}x" if n in like else "")
        ax.text(i, 1000 * report["median_seconds_per_token"][n], label, ha="center", va="bottom", fontsize=7)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set_ylim(top=1.25 * 1000 * max(report["median_seconds_per_token"].values()))  # room for two-line labels
    ax.set_ylabel("ms per decoded token (median)")
    if like:
        ax.set_title("time vs dynamic (top) and vs dynamic_inference (bottom)", fontsize=8)
    save_figure(fig, path, f"exact mode and chat decode vs DynamicCache, cache {report['cache_size']}, "
                           f"{report['environment']['threads']} thread(s)")


if __name__ == "__main__":
    main_or_replot(main, plot)
