"""`python -m eval speed fair`: each policy's fair chunk (cache B, default chunk C) against the raw forward of the same
matrix work (B + 1 - C entries before each chunk, B for a band policy, cropped back), forward by forward, in
alternating rounds (`common.alternate`); with gradients off and in inference mode. `twin_caches` is shared with
`python -m eval profile`.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from pathlib import Path

import click
import torch
from transformers import DynamicCache

from eval.common import (
    alternate,
    corpus_record,
    corpus_tokens,
    data_option,
    environment,
    load_model,
    model_option,
    new_figure,
    retrieval_heads_option,
    save_figure,
    setup,
    speed_out_dir_option,
    suite_policy,
    write_result,
)
from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import default_chunk_size


@click.command()
@click.option(
    "--policies",
    show_default=True,
    default="h2o,sink,window,tova,a2sf,h2o_sinks,sepllm,keydiff,roco,snapkv,pyramid,keyformer,cam,scissorhands",
)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--rounds", default=5, show_default=True)
@click.option("--round-tokens", default=512, show_default=True, help="Tokens per round and contender, chunks > 1.")
@click.option(
    "--exact-round-tokens",
    default=96,
    show_default=True,
    help="Tokens per round and contender for the policies whose default is exact mode (chunk 1).",
)
@click.option("--threads", default=2, show_default=True)
@data_option
@model_option
@speed_out_dir_option
@retrieval_heads_option
def fair(
    policies, cache_size, rounds, round_tokens, exact_round_tokens, threads, data, model_spec, out_dir, retrieval_heads
):
    """Fair chunks vs their raw twin, forward by forward: fair_chunks_chunked.json, fair_chunks_exact.json."""
    setup(threads)
    names = policies.split(",")
    if "head_hybrid" in names:  # a missing or bad classification fails before the model loads
        suite_policy("head_hybrid", cache_size, None, retrieval_heads)
    loaded = load_model(model_spec)
    made = {n: suite_policy(n, cache_size, loaded.tokenizer, retrieval_heads) for n in names}
    chunks = {n: default_chunk_size(made[n]) for n in names}
    for kind, group, tokens in (
        ("chunked", [n for n in names if chunks[n] > 1], round_tokens),
        ("exact", [n for n in names if chunks[n] == 1], exact_round_tokens),
    ):
        if not group:
            continue
        prefix = twin_prefix(loaded.model, make_policy("sink", cache_size))
        stream = corpus_tokens(loaded.tokenizer, prefix + rounds * tokens, data)
        rows = {name: _fair_row(loaded, name, made[name], stream, rounds, tokens) for name in group}
        report = {
            "benchmark": "fair chunks vs the raw chunked forward",
            "model": loaded.name,
            "data": corpus_record(data),
            "cache_size": cache_size,
            "environment": environment(),
            "targets": {"ratio_vs_raw_forward": 0.85},
            "throughput": rows,
            "throughput_measured_with": {
                **environment(),
                "alternate": "forwards",
                "rounds": rounds,
                "round_tokens": tokens,
            },
        }
        write_result(out_dir / f"fair_chunks_{kind}.json", report, plot_fair)


def twin_prefix(model, policy) -> int:
    """Stream tokens `twin_caches` feeds before the timed forwards: the policy's budget, or a sliding-window layer's
    window where that is longer (Gemma 3: 512), so that those layers hold their window in both caches."""
    from h2o_stream.engine.layer_types import layer_windows

    windows = [w for w in layer_windows(model.config.get_text_config(decoder=True)) if w is not None]
    return max([policy.budget, *windows])


@torch.no_grad()
def twin_caches(model, policy, stream: torch.Tensor) -> tuple[dict, int, int]:
    """({"policy": a StreamingCache, "raw": its raw twin}, the policy's fair chunk, what the twin's global layers
    hold), both fed the stream's first `twin_prefix` tokens in that chunk: the twin (a DynamicCache, cropped after
    each timed forward) holds what the policy's cache holds before a chunk, so that each forward of one equals one of
    the other in keys (a band policy holds its budget, a ranked one its budget + 1 - chunk; sliding-window layers
    their window in both)."""
    cache_size, prefix = policy.budget, twin_prefix(model, policy)
    chunk = default_chunk_size(policy)
    held = cache_size if policy.band() is not None else cache_size + 1 - chunk
    caches = {"policy": StreamingCache(model, policy), "raw": DynamicCache(config=model.config)}
    for layer in caches["raw"].layers:  # a sliding layer keeps what `crop` may take back (transformers' rule)
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    for cache in caches.values():
        for start in range(0, prefix, chunk):
            model(stream[start : min(start + chunk, prefix)].unsqueeze(0), cache=cache)
    for layer in caches["raw"].layers:
        if not hasattr(layer, "activate_past_recording"):  # a global layer: back to what the policy's holds
            layer.crop(held - prefix)  # negative: drop the newest prefix - held entries
    return caches, chunk, held


@torch.no_grad()
def _fair_row(loaded, name: str, policy, stream: torch.Tensor, rounds: int, tokens: int) -> dict:
    """One policy against its raw twin and the twin in inference mode, forward by forward (which goes first rotates).
    Per round: tokens over the summed seconds of each; speeds and ratios are medians over the rounds (the ratio of
    each round's own pair)."""
    model = loaded.model
    timed = stream[twin_prefix(model, policy) :]
    caches, chunk, held = twin_caches(model, policy, stream)
    caches["raw_inference"] = copy.deepcopy(caches["raw"])

    def step(who):
        def run(r, i):
            piece = timed[r * tokens + i * chunk : min(r * tokens + (i + 1) * chunk, (r + 1) * tokens)].unsqueeze(0)
            with torch.inference_mode() if who == "raw_inference" else contextlib.nullcontext():
                started = time.perf_counter()
                model(piece, cache=caches[who])
                seconds = time.perf_counter() - started
            if who != "policy":
                caches[who].crop(-piece.shape[-1])
            return seconds

        return run

    seconds = alternate({who: step(who) for who in caches}, rounds, per_round=-(-tokens // chunk))
    speeds = {who: statistics.median(tokens / s for s in v) for who, v in seconds.items()}
    ratios = {
        who: [s / p for s, p in zip(seconds[who], seconds["policy"], strict=True)] for who in ("raw", "raw_inference")
    }
    row = {
        "chunk_size": chunk,
        "tokens_per_second": speeds["policy"],
        "raw_forward": f"raw {held}+{chunk}",
        "raw_tokens_per_second": speeds["raw"],
        "ratio_vs_raw_forward": statistics.median(ratios["raw"]),
        "ratio_per_round": ratios["raw"],
        "raw_inference_mode_tokens_per_second": speeds["raw_inference"],
        "ratio_vs_raw_forward_in_inference_mode": statistics.median(ratios["raw_inference"]),
        "ratio_in_inference_mode_per_round": ratios["raw_inference"],
    }
    print(
        f"{name:10s} C={chunk:3d} {row['tokens_per_second']:7.1f} tok/s = {row['ratio_vs_raw_forward']:.3f}x "
        f"{row['raw_forward']} ({row['ratio_vs_raw_forward_in_inference_mode']:.3f}x in inference mode)",
        flush=True,
    )
    return row


def plot_fair(report: dict, path: Path) -> None:
    rows = report["throughput"]
    names, places = list(rows), range(len(rows))
    fig, ax = new_figure(size=(max(4.0, 0.8 * len(names) + 2), 3.6))
    ax.bar(
        [i - 0.2 for i in places],
        [rows[n]["ratio_vs_raw_forward"] for n in names],
        width=0.4,
        color="#55a868",
        label="raw forward with gradients off",
    )
    ax.bar(
        [i + 0.2 for i in places],
        [rows[n]["ratio_vs_raw_forward_in_inference_mode"] for n in names],
        width=0.4,
        color="#8172b2",
        label="the same in inference mode",
    )
    ax.set_xticks(list(places), [f"{n}\nC={rows[n]['chunk_size']}" for n in names], fontsize=8)
    ax.axhline(report["targets"]["ratio_vs_raw_forward"], color="red", linestyle="--")
    ax.legend(fontsize=7)
    ax.set_ylabel("tok/s / raw twin tok/s (median)")
    save_figure(
        fig,
        path,
        f"{report['model']}, cache {report['cache_size']}: fair chunks vs their raw twin, "
        f"{report['environment']['threads']} thread(s)",
    )
