"""The default model's raw chunked forward with its weights where transformers leaves them (memory-mapped from the
converted .safetensors file) against copied into the process's own memory, as `load_model` does now.

Every contender runs in a fresh interpreter (a mapping is a property of the process), loads the default model, warms
up with one forward and times --samples passes of --chunks chunks of 256 tokens over a DynamicCache cropped back to
256 entries (the raw forward of `bench_vs_baseline.py`). Contenders alternate over --rounds and thread counts;
medians are reported. The third contender copies the weights to addresses 16 bytes off a 64-byte boundary, to tell
the memory the weights live in from their alignment.

    python eval/bench_weights.py --data path/to/corpus.jsonl --rounds 3 --threads 1,2
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import click
from common import data_option, environment, main_or_replot, new_figure, save_figure, write_json

CONTENDERS = ("mapped (as transformers loads them)", "copied (load_model)", "copied, misaligned by 16 bytes")

CHILD = r"""
import json, statistics, sys
import torch
sys.path.insert(0, sys.argv[1])
from transformers import DynamicCache
from common import corpus_tokens, time_chunks
from h2o_stream.loading.default_model import load_default
from h2o_stream.loading.models import load_model
contender, data = sys.argv[2], sys.argv[6]
threads, chunks, samples = (int(a) for a in sys.argv[3:6])
torch.set_num_threads(threads)
if contender.startswith("copied ("):
    loaded = load_model(None)
    model, tokenizer = loaded.model, loaded.tokenizer
else:
    model, tokenizer, _ = load_default(torch.float32)
    model.eval()
    if contender.startswith("copied, misaligned"):
        for tensor in [*model.parameters(), *model.buffers()]:
            flat = torch.empty(tensor.numel() + 16, dtype=tensor.dtype)
            tensor.data = flat[4:4 + tensor.numel()].view(tensor.shape).copy_(tensor.data)
misaligned = sum(1 for tensor in model.parameters() if tensor.data_ptr() % 64)
ids = corpus_tokens(tokenizer, 256 * (chunks + 1), data)
speeds = []
with torch.no_grad():
    for _ in range(samples):
        cache = DynamicCache(config=model.config)
        model(ids[:256].unsqueeze(0), cache=cache)
        speeds.append(1 / time_chunks(model, cache, ids[256:], 256, crop=True))
print(json.dumps({"tokens_per_second": statistics.median(speeds), "samples": speeds,
                  "misaligned_parameters": misaligned, "parameters": len(list(model.parameters()))}))
"""


def run_child(contender: str, threads: int, chunks: int, samples: int, data: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).resolve().parent), contender,
                           str(threads), str(chunks), str(samples), data], capture_output=True, text=True,
                          check=False)
    if done.returncode:
        raise click.ClickException(f"{contender} at {threads} thread(s) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command()
@data_option
@click.option("--threads", "thread_counts", default="1,2", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--chunks", default=8, show_default=True, help="Chunks of 256 tokens per timed pass.")
@click.option("--samples", default=3, show_default=True, help="Timed passes per process (their median counts).")
@click.option("--out", default="eval/results/bench_weights.json", show_default=True)
def main(data, thread_counts, rounds, chunks, samples, out):
    counts = [int(t) for t in thread_counts.split(",")]
    runs = {str(t): {name: [] for name in CONTENDERS} for t in counts}
    for r in range(rounds):
        for threads in counts:
            for name in CONTENDERS:
                result = run_child(name, threads, chunks, samples, data)
                runs[str(threads)][name].append(result)
                click.echo(f"round {r + 1}, {threads} thread(s): {name:36s} {result['tokens_per_second']:6.1f} tok/s "
                           f"({result['misaligned_parameters']} of {result['parameters']} parameters off 64 bytes)")
    medians = {t: {name: statistics.median(r["tokens_per_second"] for r in rs) for name, rs in by.items()}
               for t, by in runs.items()}
    report = {"benchmark": "raw chunked forward (256 over 256 cached): weights memory-mapped vs copied", "data": data,
              "chunks_per_pass": chunks, "passes_per_process": samples, "rounds": rounds,
              "environment": environment(), "runs": runs, "median_tokens_per_second": medians,
              "copied_vs_mapped": {t: m[CONTENDERS[1]] / m[CONTENDERS[0]] for t, m in medians.items()},
              "misaligned_vs_mapped": {t: m[CONTENDERS[2]] / m[CONTENDERS[0]] for t, m in medians.items()}}
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    medians = report["median_tokens_per_second"]
    fig, ax = new_figure(1, 1, size=(6.4, 3.4))
    width = 0.26
    colors = ("#c4c4c4", "#4c72b0", "#dd8452")
    for k, (name, color) in enumerate(zip(CONTENDERS, colors)):
        xs = [i + (k - 1) * width for i in range(len(medians))]
        values = [m[name] for m in medians.values()]
        ax.bar(xs, values, width, label=name, color=color)
        for x, v in zip(xs, values):
            ax.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(medians)), [f"{t} thread(s)" for t in medians])
    ax.set_ylabel("tokens / second (median)")
    ax.legend(fontsize=7, loc="lower right")
    save_figure(fig, path, "raw 256-token forward of the default model: where its weights live")


if __name__ == "__main__":
    main_or_replot(main, plot)
