"""The two decode-speed changes of 2026-12-01, each against its absence, side by side in one process.

1. One intra-op thread for the cache's small work (its attention function and `update`, wrapped here in
   `torch.set_num_threads(1)` and restored after), against the engine as it is (the caller's thread count
   throughout): h2o decode steps over a cache of 256, and scanned `ppl`-style forwards of 256 tokens for h2o and roco
   at their default chunks. The raw decode step (a DynamicCache of 256 + up to `--block` entries) is the reference
   for the decode ratio. The engine does not do this: measured here, it gained nothing in decode steps and lost in
   scanned forwards (eval/results/bench_threads.json).
2. The sort-free top-p (`SortFreeTopPLogitsWarper`) against transformers' `TopPLogitsWarper` in `pick_token` with the
   chat's default sampling, on the default model's logits.

Blocks alternate between contenders; medians over `--rounds`.

    python eval/bench_threads.py --threads 2 --out eval/results/bench_threads.json
"""

from __future__ import annotations

import statistics
import time

import click
import torch
from common import environment, main_or_replot, new_figure, save_figure, setup, write_json
from transformers import DynamicCache, LogitsProcessorList, TopPLogitsWarper

from h2o_stream import StreamingCache, make_policy
from h2o_stream.apps.chat import chat_sampling
from h2o_stream.engine import hooks
from h2o_stream.engine.cache import default_chunk_size
from h2o_stream.generation.sampling import SortFreeTopPLogitsWarper, logits_processors, pick_token
from h2o_stream.loading.models import load_model

LAYER_ATTENTION, CACHE_UPDATE = hooks._layer_attention, StreamingCache.update


def on_one_thread(work):
    def wrapped(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return work(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)
    return wrapped


def switch_one_thread(on: bool) -> None:
    """The cache's work on one thread, or the engine as it is."""
    hooks._layer_attention = on_one_thread(LAYER_ATTENTION) if on else LAYER_ATTENTION
    StreamingCache.update = on_one_thread(CACHE_UPDATE) if on else CACHE_UPDATE


def decode_block(model, cache, ids) -> float:
    started = time.perf_counter()
    for i in range(ids.shape[1]):
        model(ids[:, i:i + 1], cache=cache)
    return (time.perf_counter() - started) / ids.shape[1]


@click.command()
@click.option("--threads", default=2, show_default=True)
@click.option("--rounds", default=6, show_default=True)
@click.option("--block", default=16, show_default=True, help="Decode steps per timed block.")
@click.option("--out", default="eval/results/bench_threads.json", show_default=True)
def main(threads, rounds, block, out):
    setup(threads)
    loaded = load_model(None)
    model = loaded.model
    generator = torch.Generator().manual_seed(0)
    stream = torch.randint(100, model.config.vocab_size - 100, (1, 256 + rounds * 512), generator=generator)
    seconds = {name: [] for name in ("raw decode step", "h2o decode, one thread on", "h2o decode, off",
                                     "h2o scanned, on", "h2o scanned, off", "roco scanned, on", "roco scanned, off")}
    caches = {}
    with torch.no_grad():
        for name in seconds:
            if name.startswith("raw"):
                continue
            policy = make_policy(name.split()[0], 256)
            scanned = "scanned" in name
            caches[name] = StreamingCache(model, policy, decide_every=default_chunk_size(policy) if scanned else None)
            model(stream[:, :256], cache=caches[name])
        for r in range(rounds):
            steps = stream[:, 256 + r * block: 256 + (r + 1) * block]
            forward = stream[:, 256 + r * 512: 256 + r * 512 + 256]
            for name in seconds:
                switch_one_thread(not name.endswith("off"))
                if name.startswith("raw"):
                    raw = DynamicCache(config=model.config)
                    model(stream[:, :256], cache=raw)
                    seconds[name].append(decode_block(model, raw, steps))
                elif "decode" in name:
                    seconds[name].append(decode_block(model, caches[name], steps))
                else:
                    started = time.perf_counter()
                    model(forward, cache=caches[name], logits_to_keep=1)
                    seconds[name].append((time.perf_counter() - started) / forward.shape[1])
        switch_one_thread(False)
        logits = model(stream[:, :256], cache=DynamicCache(config=model.config)).logits[0, -1]
    sampling = chat_sampling(seed=0)
    sort_free = logits_processors(sampling)
    parent = LogitsProcessorList([TopPLogitsWarper(p.top_p) if isinstance(p, SortFreeTopPLogitsWarper) else p
                                  for p in sort_free])
    picks = {"pick_token, sort-free top-p": sort_free, "pick_token, transformers' top-p": parent}
    pick_seconds = {name: [] for name in picks}
    for _ in range(rounds * 20):
        for name, processors in picks.items():
            started = time.perf_counter()
            pick_token(logits, list(range(100, 140)), sampling, processors, torch.Generator().manual_seed(0))
            pick_seconds[name].append(time.perf_counter() - started)
    median = {name: statistics.median(v) for name, v in {**seconds, **pick_seconds}.items()}
    tokens_per_second = {name: 1 / median[name] for name in seconds}
    raw = tokens_per_second["raw decode step"]
    report = {"benchmark": "one-thread cache work and the sort-free top-p, each against its absence",
              "model": loaded.name, "cache_size": 256, "rounds": rounds, "block": block,
              "environment": environment(), "tokens_per_second": tokens_per_second,
              "decode_ratio_vs_raw_step": {name: tokens_per_second[name] / raw for name in seconds if "decode" in name},
              "pick_token_ms": {name: 1000 * median[name] for name in picks}}
    for name, value in {**tokens_per_second, **report["pick_token_ms"]}.items():
        print(f"{name:34s} {value:8.2f}")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    fig, (left, right) = new_figure(1, 2, size=(9, 3.4))
    names = list(report["tokens_per_second"])
    left.barh(names, [report["tokens_per_second"][n] for n in names], color="#4c72b0")
    left.set_xlabel("tokens per second (median)")
    picks = list(report["pick_token_ms"])
    right.barh(picks, [report["pick_token_ms"][n] for n in picks], color="#dd8452")
    right.set_xlabel("ms per pick_token (median)")
    save_figure(fig, path, f"one-thread cache work and sort-free top-p, {report['environment']['threads']} thread(s)")


if __name__ == "__main__":
    main_or_replot(main, plot)
