"""Where a `ppl` chunk's time goes, before and after: a cProfile of `PerplexityRun.run` at two commits, side by side.

Each commit's `h2o_stream` is taken out with `git archive` and imported in a fresh interpreter (one per commit and
contender; contenders alternate between commits), which reads the same stream, warms up and profiles one run of
--tokens tokens. Every profiled function's own time is put in one of four groups by what it is and who called it:

- model matmuls: `linear` (the projections and MLPs), whoever calls it;
- transformers: the model's other work (its Python and the tensor operations it calls);
- h2o-stream: our cache and attention (our Python and the tensor operations it calls);
- other: the rest (the profiler, torch's Python, the NLL).

    python eval/profile_ppl.py --before 1c91960^ --data path/to/corpus.jsonl --out eval/results/profile_ppl.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from common import (data_option, environment, export, main_or_replot, new_figure, save_figure, setup, short_revision,
                    write_json)

GROUPS = ("model matmuls", "transformers", "h2o-stream", "other")
#: name: (policy, exact mode, stream tokens profiled)
CONTENDERS = {"sink, chunk 256": ("sink", False, 4096), "h2o, fair chunks of 16": ("h2o", False, 4096),
              "h2o exact": ("h2o", True, 512)}

CHILD = r"""
import cProfile, json, pstats, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from h2o_stream import make_policy
from h2o_stream.apps.perplexity.run import PerplexityRun
from h2o_stream.loading.models import load_model
sys.path.insert(1, sys.argv[8])
from common import corpus_tokens  # eval/common.py, over the commit's h2o_stream
policy_name, exact, data = sys.argv[2], sys.argv[3] == "1", sys.argv[6]
tokens, threads, cache = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[7])
torch.set_num_threads(threads)
loaded = load_model(None)
ids = corpus_tokens(loaded.tokenizer, 2 * tokens, data)
run = PerplexityRun(loaded.model, make_policy(policy_name, cache), chunk_size=1 if exact else None)
run.run([(0, ids)], limit=tokens)  # warm-up: the cache full, every lazy allocation made
profile = cProfile.Profile()
started = time.perf_counter()
profile.enable()
run.run([(0, ids)])  # the stream's next `tokens` (a run skips what it has fed)
profile.disable()
seconds = time.perf_counter() - started
groups = dict.fromkeys(["model matmuls", "transformers", "h2o-stream", "other"], 0.0)
def owner(filename):
    return "h2o-stream" if "/h2o_stream/" in filename else "transformers" if "/transformers/" in filename else "other"
for (filename, _, name), (_, _, own, _, callers) in pstats.Stats(profile).stats.items():
    if "_nn.linear" in name:
        groups["model matmuls"] += own
    elif filename != "~":
        groups[owner(filename)] += own
    else:  # a built-in: its time goes to whoever called it
        for (caller_file, _, _), (_, _, caller_own, _) in callers.items():
            groups[owner(caller_file)] += caller_own
print(json.dumps({"seconds": seconds, "tokens": tokens, "profiled_seconds": groups}))
"""


def profile_once(source: Path, policy: str, exact: bool, tokens: int, threads: int, data: str, cache: int) -> dict:
    """One contender at one commit, in a fresh interpreter; its profile grouped (see the module docstring)."""
    done = subprocess.run([sys.executable, "-c", CHILD, str(source), policy, "1" if exact else "0", str(tokens),
                           str(threads), data, str(cache), str(Path(__file__).resolve().parent)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise click.ClickException(f"the profile of {policy} at {source} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@click.command()
@click.option("--before", required=True, help="The commit to compare with (e.g. the one before a speed change).")
@click.option("--after", default="HEAD", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--threads", default=1, show_default=True)
@data_option
@click.option("--out", default="eval/results/profile_ppl.json", show_default=True)
def main(before, after, cache_size, threads, data, out):
    setup(threads)  # the children set their own; this records the count in the environment
    commits = {"before": before, "after": after}
    report = {"benchmark": "cProfile of PerplexityRun.run before/after", "cache_size": cache_size, "data": data,
              "commits": {k: short_revision(v) for k, v in commits.items()},
              "environment": environment(), "contenders": {}}
    with tempfile.TemporaryDirectory() as scratch:
        sources = {k: export(v, Path(scratch)) for k, v in commits.items()}
        for name, (policy, exact, tokens) in CONTENDERS.items():
            report["contenders"][name] = {}
            for when, source in sources.items():
                result = profile_once(source, policy, exact, tokens, threads, data, cache_size)
                result["profiled_ms_per_token"] = {g: 1000 * s / tokens for g, s in result["profiled_seconds"].items()}
                result["tokens_per_second"] = tokens / result["seconds"]
                report["contenders"][name][when] = result
                click.echo(f"{name:24s} {when:6s} {result['tokens_per_second']:7.1f} tok/s (under the profiler) "
                           + " ".join(f"{g} {v:.2f}" for g, v in result["profiled_ms_per_token"].items()) + " ms/tok")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    contenders = report["contenders"]
    fig, axes = new_figure(1, len(contenders), size=(3.2 * len(contenders), 3.4))
    colors = {"model matmuls": "#4c72b0", "transformers": "#8c8c8c", "h2o-stream": "#dd8452", "other": "#c4c4c4"}
    for ax, (name, runs) in zip(axes, contenders.items()):
        bottom = [0.0] * len(runs)
        for group in GROUPS:
            values = [run["profiled_ms_per_token"][group] for run in runs.values()]
            ax.bar(list(runs), values, bottom=bottom, color=colors[group], label=group)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(name, fontsize=8)
        ax.set_ylabel("profiled ms / token")
    axes[0].legend(fontsize=7)
    save_figure(fig, path, f"where a ppl token's time goes, {report['commits']['before']} vs "
                           f"{report['commits']['after']} (cache {report['cache_size']}, "
                           f"{report['environment']['threads']} thread(s), cProfile)")


if __name__ == "__main__":
    main_or_replot(main, plot)
