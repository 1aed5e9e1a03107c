"""Perplexity gap, chunked vs exact (token-by-token) mode, on the default model and a corpus (--data, default: the
shipped sample).

Exact mode decodes one token per forward, which is memory-bound on a CPU (~7 tok/s here): one 20k-token stream would
take about an hour per policy. So the corpus' first S*L tokens are cut into S consecutive streams of L tokens that run
side by side as one batch (eviction is per row; tests/test_batch.py checks a batch row equals the stream run alone).
Both modes see exactly the same S streams, each starting from an empty cache.

    python eval/bench_gap.py --streams 4 --stream-tokens 5120 --out eval/results/bench_gap.json
"""

from __future__ import annotations

import math
import time

import click
import torch
from common import corpus_tokens, data_option, environment, main_or_replot, new_figure, save_figure, setup, write_json

from h2o_stream import StreamingCache, make_policy
from h2o_stream.loading.models import load_model


@torch.no_grad()
def stream_nll(model, policy, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    """NLL (S, L-1) of every next-token prediction in S streams fed `chunk` tokens per forward."""
    cache = StreamingCache(model, policy)
    parts = []
    for start in range(0, ids.shape[1], chunk):
        logits = model(ids[:, start:start + chunk], cache=cache).logits.float()
        targets = ids[:, start + 1:start + chunk + 1]  # the last position of the last chunk predicts nothing
        logprobs = torch.log_softmax(logits[:, :targets.shape[1]], dim=-1)
        parts.append(-logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).double())
    return torch.cat(parts, dim=1)


@click.command()
@click.option("--streams", default=4, show_default=True)
@click.option("--stream-tokens", default=5120, show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--chunk-size", default=256, show_default=True)
@click.option("--policies", default="h2o,sink", show_default=True)
@data_option
@click.option("--threads", default=1, show_default=True)
@click.option("--out", default="eval/results/bench_gap.json", show_default=True)
def main(streams, stream_tokens, cache_size, chunk_size, policies, data, threads, out):
    setup(threads)
    loaded = load_model(None)
    ids = corpus_tokens(loaded.tokenizer, streams * stream_tokens, data).view(streams, stream_tokens)
    report = {"benchmark": "perplexity gap, chunked vs exact", "model": loaded.name, "data": data,
              "streams": streams, "stream_tokens": stream_tokens, "predictions": streams * (stream_tokens - 1),
              "cache_size": cache_size, "chunk_size": chunk_size, "environment": environment(),
              "target_relative_gap": 0.02, "policies": {}}
    for name in policies.split(","):
        entry = report["policies"][name] = {"split": make_policy(name, cache_size).describe()}
        nll = {}
        for mode, chunk in (("chunked", chunk_size), ("exact", 1)):
            started = time.perf_counter()
            nll[mode] = stream_nll(loaded.model, make_policy(name, cache_size), ids, chunk)
            entry[mode] = {"ppl": math.exp(nll[mode].mean().item()),
                           "ppl_per_stream": torch.exp(nll[mode].mean(dim=1)).tolist(),
                           "seconds": time.perf_counter() - started}
            print(f"{name:5s} {mode:7s} ppl {entry[mode]['ppl']:.4f} ({entry[mode]['seconds']:.0f} s)", flush=True)
            write_json(out, report)  # partial results survive an interrupted run
        entry["relative_gap"] = entry["chunked"]["ppl"] / entry["exact"]["ppl"] - 1
        entry["max_token_nll_difference"] = (nll["chunked"] - nll["exact"]).abs().max().item()
        print(f"{name:5s} chunked/exact ppl - 1 = {entry['relative_gap']:+.4%}, largest per-token NLL difference "
              f"{entry['max_token_nll_difference']:.2e}", flush=True)
        write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    names = [n for n in report["policies"] if "relative_gap" in report["policies"][n]]
    fig, (left, right) = new_figure(1, 2, size=(9, 3.6))
    for offset, mode in ((-0.2, "exact"), (0.2, "chunked")):
        left.bar([i + offset for i in range(len(names))], [report["policies"][n][mode]["ppl"] for n in names],
                 width=0.4, label=mode)
    left.set_xticks(range(len(names)), names)
    left.set_title("perplexity", fontsize=9)
    left.legend(fontsize=8)
    right.bar(names, [100 * report["policies"][n]["relative_gap"] for n in names], color="#dd8452")
    for target in (2, -2):
        right.axhline(target, color="red", linestyle="--")
    right.set_title("chunked / exact PPL - 1, % (target within ±2%)", fontsize=9)
    save_figure(fig, path, f"{report['model']}, cache {report['cache_size']}, chunk {report['chunk_size']}, "
                           f"{report['streams']} streams x {report['stream_tokens']} tokens")


if __name__ == "__main__":
    main_or_replot(main, plot)
