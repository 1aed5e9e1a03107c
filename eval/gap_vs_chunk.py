"""How chunked H2O's perplexity gap to exact mode depends on the chunk size, and what matching the span does.

A chunk of C queries over a cache of B sees up to B + C keys (exact mode: B + 1), so chunked H2O is not exact H2O.
This runs chunked H2O on the same S streams as a finished eval/bench_gap.py result and compares with its exact PPL
(exact mode is deterministic, so it is not recomputed): several chunk sizes with the full budget, and, as
docs/design.md ("Chunked mode") describes, "span-matched" runs whose kept budget is cut to B + 1 - C (fewer heavy
entries), so that no query ever sees more than B + 1 keys. `--data` must name the corpus the result was measured on.

    python eval/gap_vs_chunk.py --exact-from eval/results/bench_gap.json --chunk-sizes 16,64 --matched 16,64
"""

from __future__ import annotations

import json
import math
import time

import click
from common import corpus_tokens, data_option, environment, main_or_replot, new_figure, save_figure, setup, write_json

from bench_gap import stream_nll
from h2o_stream import make_policy
from h2o_stream.loading.corpus import describe_source
from h2o_stream.loading.models import load_model


@click.command()
@click.option("--exact-from", type=click.Path(exists=True, dir_okay=False), required=True)
@click.option("--chunk-sizes", default="16,64", show_default=True)
@click.option("--matched", default="16,64", show_default=True, help="Chunk sizes to run span-matched.")
@data_option
@click.option("--threads", default=1, show_default=True)
@click.option("--out", default="eval/results/gap_vs_chunk.json", show_default=True)
def main(exact_from, chunk_sizes, matched, data, threads, out):
    setup(threads)
    base = json.loads(open(exact_from).read())
    if describe_source(data) != describe_source(base["data"]):  # the streams must be the ones the exact PPL is of
        raise click.ClickException(f"{exact_from} was measured on {base['data']}, not {data}: pass --data with that corpus")
    exact_ppl = base["policies"]["h2o"]["exact"]["ppl"]
    budget, streams, length = base["cache_size"], base["streams"], base["stream_tokens"]
    loaded = load_model(None)
    if loaded.name != base["model"]:
        raise click.ClickException(f"{exact_from} was measured on {base['model']}, not {loaded.name}")
    ids = corpus_tokens(loaded.tokenizer, streams * length, data).view(streams, length)
    half = budget // 2
    report = {"benchmark": "chunked h2o vs exact h2o by chunk size", "model": loaded.name, "data": data,
              "streams": streams, "stream_tokens": length, "cache_size": budget, "exact_from": exact_from,
              "exact_ppl": exact_ppl, "environment": environment(), "target_relative_gap": 0.02,
              "runs": [{"chunk_size": base["chunk_size"], "span_matched": False, "policy": base["policies"]["h2o"]["split"],
                        "ppl": base["policies"]["h2o"]["chunked"]["ppl"], "max_keys_seen": budget + base["chunk_size"],
                        "relative_gap": base["policies"]["h2o"]["relative_gap"], "from": exact_from}]}
    plans = [(int(c), False) for c in chunk_sizes.split(",") if c] + [(int(c), True) for c in matched.split(",") if c]
    for chunk, span_matched in plans:
        kept = budget + 1 - chunk if span_matched else budget
        policy = make_policy("h2o", kept, recent=half) if span_matched else make_policy("h2o", budget)
        started = time.perf_counter()
        ppl = math.exp(stream_nll(loaded.model, policy, ids, chunk).mean().item())
        run = {"chunk_size": chunk, "span_matched": span_matched, "policy": policy.describe(), "ppl": ppl,
               "max_keys_seen": kept + chunk, "relative_gap": ppl / exact_ppl - 1,
               "seconds": time.perf_counter() - started}
        report["runs"].append(run)
        print(f"chunk {chunk:4d} {policy.describe():28s} ppl {ppl:.4f} gap {run['relative_gap']:+.2%}", flush=True)
        write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    fig, ax = new_figure(size=(6.5, 3.8))
    for matched, style, label in ((False, "o-", f"kept budget {report['cache_size']} (span up to B + C)"),
                                  (True, "s--", "span-matched: kept B + 1 - C")):
        runs = sorted((r for r in report["runs"] if r["span_matched"] == matched), key=lambda r: r["chunk_size"])
        if runs:
            ax.plot([r["chunk_size"] for r in runs], [100 * r["relative_gap"] for r in runs], style, label=label)
    ax.axhspan(-2, 2, color="green", alpha=0.1, label="target ±2%")
    ax.axhline(0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk size C")
    ax.set_ylabel("chunked / exact PPL - 1 (%)")
    ax.legend(fontsize=8)
    save_figure(fig, path, f"h2o, cache {report['cache_size']}: {report['streams']} streams x "
                           f"{report['stream_tokens']} tokens, exact PPL {report['exact_ppl']:.3f}")


if __name__ == "__main__":
    main_or_replot(main, plot)
