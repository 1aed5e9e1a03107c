"""`python -m eval profile`: where a policy's fair chunks spend the time their raw twin does not, operator by operator.

`speed fair` says how fast a policy's fair chunks run against their raw twin (a DynamicCache holding as many keys,
`speed.twin_caches`); this says where the difference goes. For each policy, in `--rounds` alternating rounds, torch's
profiler records `--round-tokens` tokens of the policy's forwards, then as many of the twin's, over the same text.
Per operator, the self CPU time per 1,000 tokens of each and their difference; the operators that add the most are
kept (the rest summed as "other"). The profiler's own cost per operator call falls more on the side that makes more
small calls (the policy's): the difference here is an upper bound on what the policy's operators cost, and the
shares, not the absolute times, are what to read. Writes OUT.json and OUT.png.
"""

from __future__ import annotations

import collections
from pathlib import Path

import click
import torch

from eval.common import (
    RESULTS,
    corpus_record,
    corpus_tokens,
    data_option,
    environment,
    load_model,
    model_option,
    new_figure,
    save_figure,
    setup,
    write_result,
)
from eval.speed import twin_caches

#: operators shown per policy (the rest of the difference is summed as "other")
SHOWN = 8


@click.command()
@click.option("--policies", default="sink,cam,snapkv,pyramid,keyformer", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--round-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=1, show_default=True)
@data_option
@model_option
@click.option(
    "--out",
    default=str(RESULTS / "speed" / "profile_fair"),
    show_default=True,
    help="Writes OUT.json and OUT.png.",
)
def profile(policies, cache_size, rounds, round_tokens, threads, data, model_spec, out):
    """Per policy, the operators that make its fair chunks slower than their raw twin (torch's profiler)."""
    from h2o_stream import make_policy

    setup(threads)
    loaded = load_model(model_spec)
    stream = corpus_tokens(loaded.tokenizer, cache_size + rounds * round_tokens, data)
    rows = {}
    for name in policies.split(","):
        policy = make_policy(name, cache_size, tokenizer=loaded.tokenizer)
        rows[name] = profile_row(loaded.model, policy, stream, rounds, round_tokens)
        top = ", ".join(f"{op} {ms:+.0f}" for op, ms in list(rows[name]["extra_ms_per_1k_tokens"].items())[:3])
        click.echo(f"{name:10s} {rows[name]['ms_per_1k_tokens']['policy']:7.0f} ms/1k tokens, twin "
                   f"{rows[name]['ms_per_1k_tokens']['raw']:7.0f}; most added: {top}")  # fmt: skip
    report = {
        "benchmark": "profile of fair chunks against their raw twin (torch profiler, self CPU time per operator)",
        "model": loaded.name,
        "data": corpus_record(data),
        "cache_size": cache_size,
        "rounds": rounds,
        "round_tokens": round_tokens,
        "environment": environment(),
        "policies": rows,
    }
    write_result(Path(out).with_suffix(".json"), report, plot_profile)


@torch.no_grad()
def profile_row(model, policy, stream: torch.Tensor, rounds: int, tokens: int) -> dict:
    """One policy against its twin: self CPU milliseconds per 1,000 tokens, in all and per operator, and the operators
    that add the most to the policy's time (policy minus twin), largest first, the rest as "other"."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    caches, chunk, held = twin_caches(model, policy, stream)
    timed = stream[policy.budget :]
    per_op = {who: collections.Counter() for who in caches}
    for r in range(rounds):
        for who, cache in caches.items():
            with profiler(activities=[ProfilerActivity.CPU]) as recorded:
                for start in range(r * tokens, (r + 1) * tokens, chunk):
                    piece = timed[start : min(start + chunk, (r + 1) * tokens)].unsqueeze(0)
                    model(piece, cache=cache)
                    if who == "raw":
                        cache.crop(-piece.shape[-1])
            for event in recorded.key_averages():
                per_op[who][event.key] += event.self_cpu_time_total / 1000  # microseconds -> ms
    scale = 1000 / (rounds * tokens)
    ms = {who: {op: t * scale for op, t in ops.items()} for who, ops in per_op.items()}
    extra = {op: ms["policy"].get(op, 0.0) - ms["raw"].get(op, 0.0) for op in set(ms["policy"]) | set(ms["raw"])}
    ranked = sorted(extra.items(), key=lambda item: -item[1])
    shown = dict(ranked[:SHOWN])
    shown["other"] = sum(value for _, value in ranked[SHOWN:])
    return {
        "chunk_size": chunk,
        "raw_forward": f"raw {held}+{chunk}",
        "ms_per_1k_tokens": {who: sum(values.values()) for who, values in ms.items()},
        "extra_ms_per_1k_tokens": shown,
        "policy_ms_per_1k_tokens": {op: ms["policy"].get(op, 0.0) for op in shown if op != "other"},
        "raw_ms_per_1k_tokens": {op: ms["raw"].get(op, 0.0) for op in shown if op != "other"},
    }


def plot_profile(report: dict, path: Path) -> None:
    rows = report["policies"]
    fig, axes = new_figure(1, len(rows), size=(3.4 * len(rows), 3.8))
    axes = axes if len(rows) > 1 else [axes]
    for ax, (name, row) in zip(axes, rows.items(), strict=True):
        extra = row["extra_ms_per_1k_tokens"]
        ax.barh(list(extra), list(extra.values()), color="#c44e52")
        ax.invert_yaxis()
        ax.axvline(0, color="grey", linewidth=0.8)
        total = row["ms_per_1k_tokens"]
        ax.set_title(f"{name} (C={row['chunk_size']}): {total['policy']:.0f} vs {total['raw']:.0f} ms", fontsize=8)
        ax.set_xlabel("ms per 1k tokens over the twin", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(
        fig,
        path,
        f"{report['model']}, cache {report['cache_size']}, {report['environment']['threads']} thread(s): what fair "
        "chunks add to their raw twin, per operator (torch profiler, self CPU time)",
    )
