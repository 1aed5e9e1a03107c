"""Speed: ours against the raw twin doing the same work, side by side in one process, in alternating rounds
(`common.alternate`); absolute speeds move between processes and machines, so only these ratios are claimed.

decode: exact-mode decode (and the chat's decode loop) vs the raw decode step over a DynamicCache cropped back after
each block, with gradients off (as `model.generate` runs) and under `torch.inference_mode` (as h2o-stream runs: like
for like). scan: exact mode scanned in forwards of --span and one forward per token, compiled and on tensor operations
(H2O_STREAM_COMPILED=0), vs the raw forward and decode step. fair: each policy's fair chunk (cache B, default chunk C)
vs the raw forward of the same matrix work (B + 1 - C entries before each chunk, B for a band policy, cropped back),
forward by forward. rows: a sweep as the rows of one batch vs run by run. startup: the CLI's help and a bad option.
"""

from __future__ import annotations

import contextlib
import os
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
    paired_bars,
    save_figure,
    setup,
    speed_out_dir_option,
    time_chunks,
    write_result,
)
from eval.speed.fair import fair
from eval.speed.startup import startup
from h2o_stream import StreamingCache, make_policy
from h2o_stream.engine import default_chunk_size

TENSOR_OPS = ", tensor ops"
threads_option = click.option(
    "--threads",
    default="1,2",
    show_default=True,
    help="Thread counts, comma-separated.",
    callback=lambda _context, _param, value: [int(t) for t in value.split(",")],
)


@click.group()
def speed():
    """Ours against the raw twin in alternating rounds (parts: decode, scan, fair, rows, startup)."""


speed.add_command(fair)  # the parts with modules of their own
speed.add_command(startup)


@speed.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--block", default=4, show_default=True, help="Timed decode steps per contender and round.")
@click.option("--rounds", default=32, show_default=True)
@click.option(
    "--policies",
    default="h2o,sink,window,full,tova,roco,chat",
    show_default=True,
    help="Contenders besides the raw step; chat is the chat's decode loop over an h2o cache.",
)
@threads_option
@model_option
@speed_out_dir_option
def decode(cache_size, block, rounds, policies, threads, model_spec, out_dir):
    """Exact-mode decode vs the raw decode step: decode_1thread.json, decode_2threads.json."""
    from h2o_stream.apps.chat import chat_sampling
    from h2o_stream.generation import generate

    loaded = load_model(model_spec)
    model, raw = loaded.model, ("dynamic", "dynamic_inference")
    names = [*raw, *policies.split(",")]
    margin = min(100, model.config.vocab_size // 4)
    stream = torch.randint(
        margin,
        model.config.vocab_size - margin,
        (1, cache_size + rounds * block + 1),
        generator=torch.Generator().manual_seed(0),
    )

    def fresh(name):
        if name in raw:
            cache = DynamicCache(config=model.config)
        else:
            policy = make_policy(
                "h2o" if name == "chat" else name, None if name == "full" else cache_size, tokenizer=loaded.tokenizer
            )
            cache = StreamingCache(model, policy)
        model(stream[:, :cache_size], cache=cache)
        return cache

    def step(name):
        def run(r, _):
            if name == "full":  # full grows: refilled, so that it decodes at the same length every round
                caches[name] = fresh(name)
            cache, steps = caches[name], stream[:, cache_size + r * block : cache_size + (r + 1) * block]
            started = time.perf_counter()
            if name == "chat":  # block + 1 tokens picked, block of them fed
                logits = model(steps[:, :1], cache=cache).logits[0, -1]
                generate(model, loaded.tokenizer, cache, logits, sampling, stop_ids=(), max_new_tokens=block)
            else:
                with torch.inference_mode() if name == "dynamic_inference" else contextlib.nullcontext():
                    for i in range(block):
                        model(steps[:, i : i + 1], cache=cache)
            seconds = (time.perf_counter() - started) / block
            if name in raw:
                cache.crop(-block)
            return seconds

        return run

    sampling = chat_sampling()
    for count in threads:
        setup(count)
        with torch.no_grad():
            caches = {name: fresh(name) for name in names}
            per_token = alternate({name: step(name) for name in names}, rounds)
        median = {name: statistics.median(v) for name, v in per_token.items()}
        report = {
            "benchmark": "exact-mode decode vs DynamicCache",
            "model": loaded.name,
            "cache_size": cache_size,
            "block": block,
            "rounds": rounds,
            "environment": environment(),
            "median_seconds_per_token": median,
            "ratio_vs_dynamic": {n: median[n] / median["dynamic"] for n in names[1:]},
            "ratio_vs_dynamic_inference": {n: median[n] / median["dynamic_inference"] for n in names[2:]},
            "per_block_seconds_per_token": per_token,
            "target_ratio": 1 / 0.9,
        }
        print(
            f"{count} thread(s), time vs the raw step:", {n: round(r, 3) for n, r in report["ratio_vs_dynamic"].items()}
        )
        write_result(out_dir / f"decode_{count}thread{'s' if count > 1 else ''}.json", report, plot_decode)


def plot_decode(report: dict, path: Path) -> None:
    median, like = report["median_seconds_per_token"], report["ratio_vs_dynamic_inference"]
    names = list(median)
    fig, ax = new_figure(size=(6, 3.4))
    ax.bar(names, [1000 * median[n] for n in names], color="#4c72b0")
    for i, n in enumerate(names[1:], start=1):
        label = f"{report['ratio_vs_dynamic'][n]:.2f}x" + (f"\n{like[n]:.2f}x" if n in like else "")
        ax.text(i, 1000 * median[n], label, ha="center", va="bottom", fontsize=7)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.set_ylim(top=1.25 * 1000 * max(median.values()))  # room for two-line labels
    ax.set_ylabel("ms per decoded token (median)")
    ax.set_title("time vs dynamic (top) and vs dynamic_inference (bottom)", fontsize=8)
    save_figure(
        fig,
        path,
        f"exact mode and chat decode vs DynamicCache, cache {report['cache_size']}, "
        f"{report['environment']['threads']} thread(s)",
    )


@speed.command()
@click.option("--cache-size", default=256, show_default=True)
@click.option("--span", default=256, show_default=True, help="Tokens per scanned (and raw) forward.")
@click.option("--policies", default="h2o,tova,roco,sink", show_default=True)
@threads_option
@click.option("--rounds", default=3, show_default=True)
@click.option("--tokens", default=512, show_default=True, help="Tokens per timed round for the wide contenders.")
@click.option("--step-tokens", default=32, show_default=True, help="Tokens per timed round, one forward per token.")
@data_option
@model_option
@speed_out_dir_option
def scan(cache_size, span, policies, threads, rounds, tokens, step_tokens, data, model_spec, out_dir):
    """Exact mode scanned and per token, compiled and on tensor ops, vs raw forwards: exact_scan.json."""
    loaded = load_model(model_spec)
    model = loaded.model
    stream = corpus_tokens(loaded.tokenizer, cache_size + rounds * tokens, data)
    prefix, timed = stream[:cache_size], stream[cache_size:]
    raw = lambda: DynamicCache(config=model.config)  # noqa: E731
    # name: (make a cache, tokens per forward, raw (cropped back), tokens per round)
    contenders = {
        "raw forward": (raw, span, True, tokens),
        "raw decode step": (raw, 1, True, step_tokens),
        "raw decode step, inference mode": (raw, 1, True, step_tokens),
    }
    for name in policies.split(","):
        policy = make_policy(name, cache_size, tokenizer=loaded.tokenizer)
        chunk = default_chunk_size(policy)
        if policy.band() is not None:  # exact at any width: its chunk, and decoding
            contenders[f"{name} chunk {chunk}"] = (lambda p=policy: StreamingCache(model, p), chunk, False, tokens)
        else:
            for ops in ("", TENSOR_OPS):
                contenders[f"{name} exact, scanned in {span}{ops}"] = (
                    lambda p=policy: StreamingCache(model, p, decide_every=1),
                    span,
                    False,
                    tokens,
                )
            if chunk > 1:
                contenders[f"{name} chunk {chunk}, scanned in {span}"] = (
                    lambda p=policy, k=chunk: StreamingCache(model, p, decide_every=k),
                    span,
                    False,
                    tokens,
                )
        for ops in ("", TENSOR_OPS):
            contenders[f"{name} exact, one forward each{ops}"] = (
                lambda p=policy: StreamingCache(model, p),
                1,
                False,
                step_tokens,
            )

    def step(name, cache, width, crop, count):
        def run(r, _):
            block = timed[r * tokens : r * tokens + count]
            with _scan_context(name):
                return time_chunks(model, cache, block, width, crop) / block.numel()

        return run

    report = {
        "benchmark": "exact mode compiled vs on tensor operations vs raw forwards",
        "model": loaded.name,
        "data": corpus_record(data),
        "cache_size": cache_size,
        "span": span,
        "environment": environment(),
        "threads": {},
    }
    for count in threads:
        setup(count)
        steps = {}
        for name, (make, width, crop, count_tokens) in contenders.items():
            cache = make()
            with torch.no_grad():
                model(prefix.unsqueeze(0), cache=cache)
            steps[name] = step(name, cache, width, crop, count_tokens)
        seconds = alternate(steps, rounds)
        speed_ = {name: 1 / statistics.median(v) for name, v in seconds.items()}
        report["threads"][str(count)] = {
            "tokens_per_second": speed_,
            "seconds_per_token_per_round": seconds,
            **{
                key: {n: s / speed_[base] for n, s in speed_.items()}
                for key, base in (
                    ("vs_raw_forward", "raw forward"),
                    ("vs_raw_decode_step", "raw decode step"),
                    ("vs_raw_decode_step_in_inference_mode", "raw decode step, inference mode"),
                )
            },
        }
        print(
            f"{count} thread(s), vs the raw forward:",
            {n: round(r, 3) for n, r in report["threads"][str(count)]["vs_raw_forward"].items()},
        )
    write_result(out_dir / "exact_scan.json", report, plot_scan)


@contextlib.contextmanager
def _scan_context(name: str):
    """A contender's round: the compiled loop off for the tensor-operation ones, the raw step's twin in inference
    mode."""
    os.environ["H2O_STREAM_COMPILED"] = "0" if name.endswith(TENSOR_OPS) else "1"
    try:
        with torch.inference_mode() if name.endswith("inference mode") else torch.no_grad():
            yield
    finally:
        os.environ.pop("H2O_STREAM_COMPILED")


def plot_scan(report: dict, path: Path) -> None:
    counts = list(report["threads"])
    fig, axes = new_figure(1, len(counts), size=(6.5 * len(counts), 5))
    axes = axes if len(counts) > 1 else [axes]

    def colors(n):
        if n.startswith("raw"):
            return "#888888"
        if n.endswith(TENSOR_OPS):
            return "#dd8452"
        return "#55a868" if " chunk " in n else "#4c72b0"

    for ax, count in zip(axes, counts, strict=True):
        speed_ = report["threads"][count]["tokens_per_second"]
        ax.barh(list(speed_), list(speed_.values()), color=[colors(n) for n in speed_])
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("tokens / second (log scale)")
        ax.set_title(f"{count} thread(s)", fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
    save_figure(
        fig,
        path,
        f"{report['model']}, cache {report['cache_size']}, forwards of {report['span']}\nblue: "
        "exact mode compiled, orange: exact mode on tensor operations, green: chunks, grey: raw",
    )


@speed.command()
@click.option("--policies", default="h2o,sink,tova,a2sf", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--tokens", default=2048, show_default=True, help="Stream tokens per run.")
@threads_option
@click.option("--rounds", default=2, show_default=True)
@data_option
@model_option
@speed_out_dir_option
def rows(policies, cache_size, tokens, threads, rounds, data, model_spec, out_dir):
    """A sweep's runs as rows of one batch vs one after another: rows.json."""
    from h2o_stream.apps.perplexity.rows import RunRows
    from h2o_stream.apps.perplexity.run import PerplexityRun
    from h2o_stream.apps.perplexity.stream import token_pieces

    loaded = load_model(model_spec)
    stream, names = corpus_tokens(loaded.tokenizer, tokens, data), policies.split(",")
    made = {}

    def step(way):
        def run(_r, _i):
            made[way] = [
                PerplexityRun(loaded.model, make_policy(n, cache_size, tokenizer=loaded.tokenizer), record_tokens=True)
                for n in names
            ]
            started = time.perf_counter()
            if way == "rows":
                RunRows(made[way]).run(token_pieces(stream))
            else:
                for one in made[way]:
                    one.run(token_pieces(stream))
            return time.perf_counter() - started

        return run

    seconds = {}
    for count in threads:
        setup(count)
        seconds[str(count)] = alternate({way: step(way) for way in ("rows", "one after another")}, rounds)
    speed_ = {
        c: {way: len(names) * tokens / statistics.median(v) for way, v in ways.items()} for c, ways in seconds.items()
    }
    gaps = {
        n: (torch.cat(a.token_nll) - torch.cat(b.token_nll)).abs().mean().item()
        for n, a, b in zip(names, made["rows"], made["one after another"], strict=True)
    }
    report = {
        "benchmark": "batched sweep rows vs runs one after another",
        "model": loaded.name,
        "policies": names,
        "cache_size": cache_size,
        "tokens_per_run": tokens,
        "data": corpus_record(data),
        "environment": environment(),
        "seconds": seconds,
        "sweep_tokens_per_second": speed_,
        "rows_vs_one_after_another": {c: s["rows"] / s["one after another"] for c, s in speed_.items()},
        "mean_abs_token_nll_difference": gaps,
    }
    print("rows vs one after another, by thread count:", report["rows_vs_one_after_another"])
    write_result(out_dir / "rows.json", report, plot_rows)


def plot_rows(report: dict, path: Path) -> None:
    fig, ax = new_figure(1, 1, size=(5, 3.2))
    paired_bars(
        ax,
        {f"{count} thread(s)": ways for count, ways in report["sweep_tokens_per_second"].items()},
        ("rows", "one after another"),
        "sweep tokens / second",
    )
    save_figure(
        fig,
        path,
        f"{len(report['policies'])} runs ({', '.join(report['policies'])}) at cache "
        f"{report['cache_size']}, {report['tokens_per_run']:,} tokens each",
    )
