"""One layer's own cache work per decode step, at two commits, without the model (far less noisy than a whole step).

A `StreamingLayer` of the default model's shape (3 KV heads of dimension 64, float32, rolling) at cache 256 takes,
per step, what exact mode gives it: `update` with one new key/value (un-rotation, append, rotation of all keys to
their slots), the attention each entry received (a fixed random vector), and the cut back to the budget. Each commit's
tree runs in a fresh interpreter; rounds alternate between the commits; medians of microseconds per step per layer.

    python eval/bench_layer.py --before 4726b47^ --after 4726b47 --policies h2o,sink,tova --threads 1
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import click
from common import (environment, export, main_or_replot, new_figure, paired_bars, save_figure, setup, short_revision,
                    write_json)

CHILD = r"""
import json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from transformers import LlamaConfig, LlamaForCausalLM
from h2o_stream import make_policy
from h2o_stream.engine.layer import StreamingLayer
from h2o_stream.rope_rolling import RopeRoller
policy_name, steps, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
config = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=1,
                     intermediate_size=64, vocab_size=64, max_position_embeddings=8192, rope_theta=100000.0)
roller = RopeRoller.for_model(LlamaForCausalLM(config))
policy = make_policy(policy_name, 256)
layer = StreamingLayer(policy, roller)
keys, values = torch.randn(1, 3, 256, 64), torch.randn(1, 3, 256, 64)
layer.update(keys, values)
layer.after_attention(torch.rand(1, 3, 256) if policy.needs_scores else None)
new_keys, new_values = torch.randn(steps, 1, 3, 1, 64), torch.randn(steps, 1, 3, 1, 64)
received = torch.rand(steps, 1, 3, 257)
def step(i):
    layer.update(new_keys[i], new_values[i])
    layer.after_attention(received[i] if policy.needs_scores else None)
for i in range(200):
    step(i)
started = time.perf_counter()
for i in range(steps):
    step(i)
print(json.dumps({"microseconds_per_step": 1e6 * (time.perf_counter() - started) / steps}))
"""


def time_layer(tree: Path, policy: str, steps: int, threads: int) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, str(tree), policy, str(steps), str(threads)],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise click.ClickException(f"{policy} at {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["microseconds_per_step"]


@click.command()
@click.option("--before", required=True)
@click.option("--after", default="HEAD", show_default=True)
@click.option("--policies", default="h2o,sink,tova", show_default=True)
@click.option("--steps", default=3000, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--threads", default=1, show_default=True)
@click.option("--out", default="eval/results/bench_layer.json", show_default=True)
def main(before, after, policies, steps, rounds, threads, out):
    setup(threads)
    commits = {"before": before, "after": after}
    samples = {p: {w: [] for w in commits} for p in policies.split(",")}
    with tempfile.TemporaryDirectory() as scratch:
        trees = {w: export(c, Path(scratch)) for w, c in commits.items()}
        for r in range(rounds):
            for policy in samples:
                for when, tree in trees.items():
                    samples[policy][when].append(time_layer(tree, policy, steps, threads))
            click.echo(f"round {r + 1}: " + ", ".join(f"{p} {w} {v[w][-1]:.0f}" for p, v in samples.items()
                                                      for w in commits))
    medians = {p: {w: statistics.median(v) for w, v in by.items()} for p, by in samples.items()}
    report = {"benchmark": "one layer's cache work per decode step, before/after",
              "commits": {w: short_revision(c) for w, c in commits.items()},
              "cache_size": 256, "steps": steps, "rounds": rounds, "environment": environment(),
              "microseconds_per_step": samples, "median_microseconds_per_step": medians,
              "after_over_before": {p: m["after"] / m["before"] for p, m in medians.items()}}
    for p, m in medians.items():
        click.echo(f"{p:6s} before {m['before']:6.1f} us, after {m['after']:6.1f} us per step and layer "
                   f"({m['after'] / m['before']:.3f}x)")
    write_json(out, report)
    plot(report, out.replace(".json", ".png"))


def plot(report: dict, path: str) -> None:
    medians = report["median_microseconds_per_step"]
    fig, ax = new_figure(size=(6, 3.4))
    paired_bars(ax, medians, ("before", "after"), "µs per step, one layer (median)")
    save_figure(fig, path, f"one layer's cache work per decode step, {report['commits']['before']} vs "
                           f"{report['commits']['after']}, cache {report['cache_size']}, "
                           f"{report['environment']['threads']} thread(s)")


if __name__ == "__main__":
    main_or_replot(main, plot)
