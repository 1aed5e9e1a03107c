"""`ppl` sink's work per 256-token chunk against the model's raw eager chunked forward, in one process, at two commits.

Single `ppl` runs are too noisy on this machine to tell a few percent apart (bench_vs_baseline: single rounds moved
by up to 30%), so here both contenders alternate chunk by chunk inside one process, and their ratio is taken there:

- raw: the default model's eager forward of 256 tokens over a DynamicCache of 256 entries, cropped back after each
  chunk (the same span as chunked sink, no cache logic, no perplexity);
- ppl sink: `PerplexityRun.feed_chunk` of the commit, i.e. the sink cache's forward of 256 tokens (cache 256, fair
  chunks, rolling) and the perplexity accounting `ppl` does per chunk (the per-token NLL and the rest).

Each commit's tree runs in a fresh interpreter (children alternate between the commits); both read the same corpus
tokens. Medians of seconds per chunk within a child; the report gives each child's ratio and their median.

    python eval/bench_sink_chunk.py --before 97bc2d2 --after HEAD --data path/to/corpus.jsonl --threads 1,2
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click
import torch
from common import (corpus_tokens, data_option, environment, export, main_or_replot, save_pairs_by_threads,
                    short_revision, write_json)

from h2o_stream.loading.models import load_model

CHILD = r"""
import json, statistics, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from transformers import DynamicCache
from h2o_stream import make_policy
from h2o_stream.apps.perplexity.run import PerplexityRun
from h2o_stream.loading.models import load_model
threads, chunks, ids = int(sys.argv[2]), int(sys.argv[3]), torch.load(sys.argv[4])
torch.set_num_threads(threads)
model = load_model(None).model
run = PerplexityRun(model, make_policy("sink", 256), chunk_size=256)
raw = DynamicCache(config=model.config)
def raw_chunk(piece):
    model.set_attn_implementation("eager")
    started = time.perf_counter()
    with torch.no_grad():
        model(piece.unsqueeze(0), cache=raw)
    raw.crop(-piece.numel())
    seconds = time.perf_counter() - started
    model.set_attn_implementation("h2o_stream")
    return seconds
def ppl_chunk(piece):
    started = time.perf_counter()
    run.feed_chunk(piece)
    return time.perf_counter() - started
raw_chunk(ids[:256])
ppl_chunk(ids[:256])
times = {"raw": [], "ppl": []}
for i in range(1, chunks + 1):
    times["raw"].append(raw_chunk(ids[256 * i:256 * (i + 1)]))  # one chunk each, alternating
    times["ppl"].append(ppl_chunk(ids[256 * i:256 * (i + 1)]))
print(json.dumps(times))
"""


def time_child(tree: Path, threads: int, chunks: int, ids_file: Path) -> dict[str, list[float]]:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(threads), str(chunks), str(ids_file)],
                          capture_output=True, text=True, check=False, cwd=tree)
    if done.returncode:
        raise click.ClickException(f"the child at {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--before", required=True)
@click.option("--after", default="HEAD", show_default=True)
@data_option
@click.option("--threads", "thread_counts", default="1,2", show_default=True)
@click.option("--chunks", default=16, show_default=True, help="Timed chunks of 256 tokens per contender and child.")
@click.option("--rounds", default=3, show_default=True, help="Children per commit and thread count.")
@click.option("--out", default="eval/results/bench_sink_chunk.json", show_default=True)
def main(before, after, data, thread_counts, chunks, rounds, out):
    commits = {"before": before, "after": after}
    threads_list = [int(t) for t in thread_counts.split(",")]
    ids = corpus_tokens(load_model(None).tokenizer, 256 * (chunks + 1), data)
    children = {str(t): {w: [] for w in commits} for t in threads_list}
    with tempfile.TemporaryDirectory() as scratch:
        ids_file = Path(scratch) / "ids.pt"
        torch.save(ids, ids_file)
        trees = {w: export(c, Path(scratch)) for w, c in commits.items()}
        for r in range(rounds):
            for threads in threads_list:
                for when, tree in trees.items():
                    times = time_child(tree, threads, chunks, ids_file)
                    raw, ppl = statistics.median(times["raw"]), statistics.median(times["ppl"])
                    children[str(threads)][when].append({"raw_tokens_per_second": 256 / raw,
                                                         "ppl_tokens_per_second": 256 / ppl,
                                                         "ppl_over_raw": raw / ppl, "seconds_per_chunk": times})
                    click.echo(f"round {r + 1}, {threads} thread(s), {when}: raw {256 / raw:.0f} tok/s, ppl sink "
                               f"{256 / ppl:.0f} tok/s, ratio {raw / ppl:.3f}")
    medians = {t: {w: statistics.median(c["ppl_over_raw"] for c in by[w]) for w in commits}
               for t, by in children.items()}
    report = {"benchmark": "ppl sink per chunk vs the raw eager chunked forward, in one process, two commits",
              "commits": {w: short_revision(c) for w, c in commits.items()}, "data": data, "cache_size": 256,
              "chunk_size": 256, "chunks_per_child": chunks, "rounds": rounds, "environment": environment(),
              "children": children, "median_ppl_over_raw": medians}
    for t, by in medians.items():
        click.echo(f"{t} thread(s): ppl sink / raw eager forward, before {by['before']:.3f}, after {by['after']:.3f}")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    save_pairs_by_threads(report["median_ppl_over_raw"], ("before", "after"), "ppl sink tok/s / raw eager tok/s", path,
                          f"ppl sink vs raw eager chunked forward, {report['commits']['before']} vs "
                          f"{report['commits']['after']}, cache 256, chunk 256", reference=1.0)


if __name__ == "__main__":
    main_or_replot(main, plot)
