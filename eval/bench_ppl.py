"""Chunked streaming on the default model and a corpus (--data, default: the shipped sample), side by side in one run.

1. throughput: our chunked forward (policy, cache B, chunk C) vs the model's raw chunked forward with no cache logic
   at the same attention span (a DynamicCache holding B tokens, C new tokens, cropped back to B after each chunk);
   rounds alternate between contenders so machine noise hits both alike;
2. chunked vs exact (token-by-token) throughput;
(the perplexity gap chunked vs exact is eval/bench_gap.py).

    python eval/bench_ppl.py --threads 2 --out eval/results/bench_ppl.json
    # span-matched H2O (kept B + 1 - C, so no query sees more than B + 1 keys; see eval/gap_vs_chunk.py):
    python eval/bench_ppl.py --cache-size 193 --recent 128 --chunk-size 64 --policies h2o \
        --out eval/results/bench_ppl_span_matched.json
"""

from __future__ import annotations

import statistics

import click
import torch
from common import (corpus_tokens, data_option, environment, main_or_replot, new_figure, save_figure, setup,
                    time_chunks, write_json)
from transformers import DynamicCache

from h2o_stream import StreamingCache, make_policy
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--chunk-size", default=256, show_default=True)
@click.option("--policies", default="h2o,sink", show_default=True)
@click.option("--recent", type=int, default=None, help="Recent window (default: each policy's paper split).")
@click.option("--rounds", default=4, show_default=True)
@click.option("--round-tokens", default=2048, show_default=True, help="Tokens per timed round and contender.")
@click.option("--exact-tokens", default=256, show_default=True, help="Tokens timed in exact mode per policy.")
@data_option
@click.option("--threads", default=2, show_default=True)
@click.option("--out", default="eval/results/bench_ppl.json", show_default=True)
def main(cache_size, chunk_size, policies, recent, rounds, round_tokens, exact_tokens, data, threads, out):
    setup(threads)
    loaded = load_model(None)
    model = loaded.model
    policies = policies.split(",")
    need = cache_size + rounds * round_tokens + exact_tokens
    stream = corpus_tokens(loaded.tokenizer, need, data)
    prefix, timed = stream[:cache_size], stream[cache_size:]

    # 1. chunked throughput vs the raw forward at the same span, interleaved
    caches = {"raw": DynamicCache(config=model.config)}
    for name in policies:
        caches[name] = StreamingCache(model, make_policy(name, cache_size, recent=recent))
    with torch.no_grad():
        for cache in caches.values():
            model(prefix.unsqueeze(0), cache=cache)
    per_token = {name: [] for name in caches}
    for r in range(rounds):
        block = timed[r * round_tokens:(r + 1) * round_tokens]
        for name, cache in caches.items():
            per_token[name].append(time_chunks(model, cache, block, chunk_size, crop=name == "raw"))
    chunked = {name: 1 / statistics.median(v) for name, v in per_token.items()}

    # 2. exact mode throughput (same policies, continuing the same caches)
    exact = {}
    offset = rounds * round_tokens
    for name in policies:
        exact[name] = 1 / time_chunks(model, caches[name], timed[offset:offset + exact_tokens], 1, crop=False)

    report = {"benchmark": "chunked streaming throughput",
              "model": loaded.name, "data": data, "cache_size": cache_size, "chunk_size": chunk_size,
              "policies": {name: caches[name].policy.describe() for name in policies},
              "environment": environment(), "tokens_per_second_chunked": chunked,
              "tokens_per_second_exact": exact,
              "ratio_vs_raw_forward": {n: chunked[n] / chunked["raw"] for n in policies},
              "speedup_vs_exact": {n: chunked[n] / exact[n] for n in policies},
              "targets": {"ratio_vs_raw_forward": 0.85, "speedup_vs_exact": 15}}
    for n in policies:
        print(f"{n:5s} chunked {chunked[n]:7.1f} tok/s = {report['ratio_vs_raw_forward'][n]:.3f}x raw forward "
              f"({chunked['raw']:.1f} tok/s); exact {exact[n]:.1f} tok/s -> {report['speedup_vs_exact'][n]:.1f}x")
    write_json(out, report)

    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    policies = list(report["ratio_vs_raw_forward"])
    fig, axes = new_figure(1, 2, size=(7.5, 3.6))
    panels = [("ratio_vs_raw_forward", "chunked / raw forward (tok/s)", 0.85),
              ("speedup_vs_exact", "chunked / exact (tok/s)", 15)]
    for ax, (key, title, target) in zip(axes, panels):
        ax.bar(policies, [report[key][p] for p in policies], color="#4c72b0")
        ax.axhline(target, color="red", linestyle="--", label=f"target {target}")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, chunk {report['chunk_size']}")


if __name__ == "__main__":
    main_or_replot(main, plot)
