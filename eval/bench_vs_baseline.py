"""`h2o-stream ppl` today against `ppl` at an earlier commit and against the model's raw chunked forward, side by side.

The speed issue quotes `ppl` chunked at 272 tok/s with 2 threads (167-173 with 1) as measured on 2026-11-30 at
commit d559c09, and asks for >= 1.4x that for the fastest configuration `ppl` offers by default, never slower than
the raw eager chunked forward at the same span. A number measured on another machine on another day says little, so
this script measures both commits here, in one run:

- every contender runs in a fresh interpreter: `python -m h2o_stream ppl ...` over the commit's tree (extracted with
  `git archive`), started in that tree with it on PYTHONPATH (checked: it imports that tree's h2o_stream), its
  speed read from the result file (`tokens_per_second`: tokens fed over the seconds spent feeding them, model
  loading excluded);
- raw: the model's own chunked forward of C = 256 tokens over a DynamicCache cropped back to 256 entries after every
  chunk (the same span as chunked sink, no cache logic), with eager attention and with SDPA;
- rounds alternate over every contender and thread count, so machine noise hits all alike; medians are reported.

    python eval/bench_vs_baseline.py --data path/to/corpus.jsonl --baseline d559c09 --threads 1,2 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from common import environment, export, main_or_replot, new_figure, save_figure, short_revision, write_json

#: name: (tree, ppl arguments) for `ppl` contenders; the tree is "baseline" or "head"
PPL_CONTENDERS = {
    "baseline ppl sink (C 256)": ("baseline", ["--policy", "sink", "--chunk-size", "256"]),
    "baseline ppl h2o (C 256, queries see B + C)": ("baseline", ["--policy", "h2o", "--chunk-size", "256"]),
    "ppl sink (default, C 256)": ("head", ["--policy", "sink"]),
    "ppl h2o (default: fair chunks of 16, scanned)": ("head", ["--policy", "h2o"]),
    "ppl h2o --wide-chunks --chunk-size 256": ("head", ["--policy", "h2o", "--wide-chunks", "--chunk-size", "256"]),
}
RAW_CONTENDERS = {"raw eager forward (C 256 over 256)": "eager", "raw SDPA forward (C 256 over 256)": "sdpa"}

RAW_CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[5])
from transformers import DynamicCache
from common import corpus_tokens, time_chunks
from h2o_stream.loading.models import load_model
implementation, threads, tokens, data = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(threads)
loaded = load_model(None)
loaded.model.set_attn_implementation(implementation)
ids = corpus_tokens(loaded.tokenizer, 256 + tokens, data)
cache = DynamicCache(config=loaded.model.config)
with torch.no_grad():
    loaded.model(ids[:256].unsqueeze(0), cache=cache)
seconds_per_token = time_chunks(loaded.model, cache, ids[256:], 256, crop=True)
print(json.dumps({"tokens_per_second": 1 / seconds_per_token}))
"""


def tree_environment(tree: Path) -> dict:
    """How a child runs `tree`'s h2o_stream: in `tree`, with `tree` first on its path.

    `python -m` puts its working directory before PYTHONPATH, so a child started in the repository would import
    today's h2o_stream whatever PYTHONPATH says (the first version of this script measured today's code twice that
    way); `check_tree` makes sure it does not happen again.
    """
    return {"cwd": tree, "env": {**os.environ, "PYTHONPATH": str(tree)}}


def check_tree(tree: Path) -> None:
    """Fail unless a child started as `run_ppl` starts it imports h2o_stream from `tree`."""
    done = subprocess.run([sys.executable, "-c", "import h2o_stream; print(h2o_stream.__file__)"],
                          capture_output=True, text=True, check=True, **tree_environment(tree))
    imported = Path(done.stdout.strip()).resolve()
    if not imported.is_relative_to(tree.resolve()):
        raise click.ClickException(f"a child meant to run {tree} imported h2o_stream from {imported}")


def run_ppl(tree: Path, arguments: list[str], threads: int, tokens: int, data: str, scratch: Path) -> float:
    """tok/s of one `ppl` run over `tree`'s h2o_stream, from its result file."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    command = [sys.executable, "-m", "h2o_stream", "ppl", "--data", data, "--tokens", str(tokens), "--threads",
               str(threads), "--cache-size", "256", "--out", str(out / "run"), *arguments]
    done = subprocess.run(command, capture_output=True, text=True, check=False, **tree_environment(tree))
    if done.returncode:
        raise click.ClickException(f"{' '.join(command)} failed over {tree}:\n{done.stderr[-2000:]}")
    results = [p for p in (out / "run").glob("*-256.json")]
    if len(results) != 1:
        raise click.ClickException(f"expected one result file in {out / 'run'}, found {results}")
    return json.loads(results[0].read_text())["tokens_per_second"]


def run_raw(implementation: str, threads: int, tokens: int, data: str) -> float:
    done = subprocess.run([sys.executable, "-c", RAW_CHILD, implementation, str(threads), str(tokens), data,
                           str(Path(__file__).resolve().parent)], capture_output=True, text=True, check=False)
    if done.returncode:
        raise click.ClickException(f"the raw {implementation} forward failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_second"]


@click.command()
@click.option("--baseline", default="d559c09", show_default=True,
              help="The commit to compare with (d559c09: main when the speed issue measured 272 tok/s).")
@click.option("--data", required=True, help="Corpus both commits read (a .jsonl with PG-19's columns).")
@click.option("--tokens", default=4096, show_default=True, help="Stream tokens per run.")
@click.option("--threads", "thread_counts", default="1,2", show_default=True)
@click.option("--rounds", default=3, show_default=True)
@click.option("--out", default="eval/results/bench_vs_baseline.json", show_default=True)
def main(baseline, data, tokens, thread_counts, rounds, out):
    counts = [int(t) for t in thread_counts.split(",")]
    data = str(Path(data).resolve()) if Path(data).exists() else data  # the children run in their trees
    revision, head = short_revision(baseline), short_revision("HEAD")
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--", "h2o_stream"], capture_output=True,
                                text=True, check=True).stdout.strip())
    names = [*PPL_CONTENDERS, *RAW_CONTENDERS]
    samples = {str(t): {name: [] for name in names} for t in counts}
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        trees = {"baseline": export(baseline, scratch), "head": Path(__file__).resolve().parents[1]}
        for tree in trees.values():  # warm-up: each tree prepares the default model its own way once
            check_tree(tree)
            run_ppl(tree, ["--policy", "sink"], 1, 256, data, scratch)
        for r in range(rounds):
            for threads in counts:
                for name in names:
                    if name in PPL_CONTENDERS:
                        tree, arguments = PPL_CONTENDERS[name]
                        speed = run_ppl(trees[tree], arguments, threads, tokens, data, scratch)
                    else:
                        speed = run_raw(RAW_CONTENDERS[name], threads, tokens, data)
                    samples[str(threads)][name].append(speed)
                    click.echo(f"round {r + 1}, {threads} thread(s): {name:48s} {speed:7.1f} tok/s")
    medians = {t: {name: statistics.median(v) for name, v in by_name.items()} for t, by_name in samples.items()}
    ratios = {}
    for t, m in medians.items():
        raw = m["raw eager forward (C 256 over 256)"]
        ratios[t] = {name: {"vs baseline ppl sink": m[name] / m["baseline ppl sink (C 256)"],
                            "vs raw eager forward": m[name] / raw} for name in PPL_CONTENDERS}
    report = {"benchmark": "ppl today vs ppl at an earlier commit vs the raw chunked forward, side by side",
              "baseline": revision, "head": head + ("+uncommitted" if dirty else ""), "data": data,
              "cache_size": 256, "tokens_per_run": tokens, "rounds": rounds, "environment": environment(),
              "tokens_per_second": samples, "median_tokens_per_second": medians, "ratios": ratios,
              "target": "fastest default ppl configuration >= 1.4x the baseline's, never below the raw eager forward"}
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    medians = report["median_tokens_per_second"]
    fig, axes = new_figure(1, len(medians), size=(5.5 * len(medians), 4.2))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (threads, by_name) in zip(axes, medians.items()):
        names = list(by_name)
        colors = ["#c4c4c4" if n.startswith("baseline") else "#8c8c8c" if n.startswith("raw") else "#4c72b0"
                  for n in names]
        ax.barh(range(len(names)), [by_name[n] for n in names], color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=7)
        ax.invert_yaxis()
        for i, n in enumerate(names):
            ax.text(by_name[n], i, f" {by_name[n]:.0f}", va="center", fontsize=7)
        ax.set_xlabel("tok/s (median)")
        ax.set_title(f"{threads} thread(s)", fontsize=9)
    save_figure(fig, path, f"ppl at {report['head']} vs ppl at {report['baseline']} vs raw forward, cache 256")


if __name__ == "__main__":
    main_or_replot(main, plot)
