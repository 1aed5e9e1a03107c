"""Soak: long chats and generated text, on the default model (the part `defaults` is in eval/soak/defaults.py).

chat: `ChatSession` over hundreds of turns in one session, memory and speed sampled after every turn. The claim under
test: with a fixed-size cache the chat's memory never grows and its speed does not degrade, however long the
conversation. User turns are passages from a corpus (`--data`; lengths varied, some alone longer than the cache) with a
short instruction; replies are sampled with the chat's settings. Pass criteria: RSS after the last turn <= 1.05 x RSS
after turn 10, and generation speed flat (last / turn 10; since a single turn's speed is noisy on a shared machine,
the median of the last 10 turns over the median of turns 10-19 is reported too).
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path

import click
import torch

from eval.common import (
    RESULTS,
    corpus_record,
    data_option,
    environment,
    load_model,
    new_figure,
    save_figure,
    write_result,
)
from eval.soak.defaults import defaults
from h2o_stream.apps.chat import CHAT_SAMPLING, ChatSession
from h2o_stream.generation import Sampling
from h2o_stream.loading.corpus import describe_source, iter_books


@click.group()
def soak():
    """Long chats and generated text (parts: chat, defaults)."""


soak.add_command(defaults)  # a part with a module of its own


INSTRUCTIONS = [
    "Summarize this passage in one sentence:",
    "Who is speaking here, and what do they want?",
    "What is the mood of this passage?",
    "Explain this passage to a child:",
    "Continue this story briefly:",
    "What happens next?",
]


def paragraphs(data: str, books: int) -> list[str]:
    """Paragraphs (blank-line separated, line breaks joined) of the first `books` books, at least 80 characters."""
    out = []
    for _, book in zip(range(books), iter_books(data), strict=False):
        for block in book.text.split("\n\n"):
            block = " ".join(block.split())
            if len(block) >= 80:
                out.append(block)
    return out


def user_turns(pool: list[str], tokenizer, rng: random.Random):
    """Endless user messages: 60% short (~20-120 tokens), 30% medium (~120-250), 10% long (~300-700 tokens, longer
    than a 256-entry cache on their own), built from consecutive paragraphs."""
    while True:
        kind = rng.random()
        low, high = (20, 120) if kind < 0.6 else (120, 250) if kind < 0.9 else (300, 700)
        target = rng.randint(low, high)
        start = rng.randrange(len(pool) - 40)
        ids = tokenizer("\n\n".join(pool[start : start + 40]), add_special_tokens=False)["input_ids"][:target]
        text = tokenizer.decode(ids).strip()
        yield f"{rng.choice(INSTRUCTIONS)}\n\n{text}"


def plot_chat(result: dict, path) -> None:
    """RSS, generation speed and cache occupancy per turn, from a result JSON."""
    series, summary = result["series"], result["summary"]
    turns = series["turn"]
    fig, (ax_rss, ax_speed, ax_cache) = new_figure(3, 1, size=(9, 9))
    rss = [b / 2**20 for b in series["rss_bytes"]]
    ax_rss.plot(turns, rss, lw=1.2, label="RSS")
    reference = summary["rss_after_turn_10_bytes"] / 2**20
    ax_rss.axhline(reference, color="grey", ls=":", lw=1, label="after turn 10")
    ax_rss.axhline(1.05 * reference, color="red", ls="--", lw=1, label="1.05 × after turn 10 (limit)")
    ax_rss.set_ylabel("RSS (MiB)")
    ax_rss.set_ylim(0, max(max(rss), 1.05 * reference) * 1.15)
    ax_rss.legend(loc="lower right", fontsize=8)

    ax_speed.plot(turns, series["decode_tokens_per_second"], lw=0.8, alpha=0.6, label="generation, per turn")
    window = 10
    rolling = [
        statistics.median(series["decode_tokens_per_second"][max(0, i - window + 1) : i + 1]) for i in range(len(turns))
    ]
    ax_speed.plot(turns, rolling, lw=1.6, label=f"generation, median of last {window} turns")
    ax_speed.set_ylabel("tokens / s")
    ax_speed.set_ylim(0, max(series["decode_tokens_per_second"]) * 1.15)
    ax_speed.legend(loc="lower right", fontsize=8)

    ax_cache.plot(turns, series["cache_slots"], lw=1.2, label="cache occupancy (entries per layer & KV head)")
    ax_cache.axhline(summary["cache_size"], color="red", ls="--", lw=1, label="budget")
    ax_cache.plot(turns, series["prompt_tokens"], lw=0.6, alpha=0.6, label="user-turn tokens")
    ax_cache.set_ylabel("tokens")
    ax_cache.set_xlabel("turn")
    ax_cache.legend(loc="upper right", fontsize=8)
    save_figure(
        fig,
        path,
        f"chat soak: {summary['turns']} turns, {summary['tokens_seen']} tokens, "
        f"{summary['policy']} (cache {summary['cache_size']})",
    )


@soak.command()
@click.option("--model", "model_spec", default=None, help="Default: SmolLM2-135M-Instruct.")
@click.option("--policy", default="h2o", show_default=True)
@click.option("--cache-size", default=256, show_default=True)
@click.option("--turns", default=200, show_default=True, help="At least this many turns ...")
@click.option("--min-tokens", default=50_000, show_default=True, help="... and at least this many tokens seen.")
@click.option("--max-new-tokens", default=40, show_default=True)
@click.option("--temperature", default=CHAT_SAMPLING["temperature"], show_default=True)
@click.option("--top-p", default=CHAT_SAMPLING["top_p"], show_default=True)
@click.option("--repetition-penalty", default=CHAT_SAMPLING["repetition_penalty"], show_default=True)
@click.option("--no-repeat-ngram-size", default=CHAT_SAMPLING["no_repeat_ngram_size"], show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--threads", default=2, show_default=True)
@data_option
@click.option("--books", default=21, show_default=True, help="Read passages from at most this many books of --data.")
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RESULTS / "soak" / "chat_soak.json",
    show_default=True,
    help="JSON path; the PNG goes beside it.",
)
def chat(
    model_spec,
    policy,
    cache_size,
    turns,
    min_tokens,
    max_new_tokens,
    temperature,
    top_p,
    repetition_penalty,
    no_repeat_ngram_size,
    seed,
    threads,
    data,
    books,
    out,
):
    """Hundreds of chat turns in one session, RSS and speed per turn: soak/chat_soak.json (10-20 min)."""
    torch.set_num_threads(threads)
    from h2o_stream import make_policy
    from h2o_stream.apps.chat import rss_bytes

    loaded = load_model(model_spec, threads=threads)
    sampling = Sampling(
        temperature=temperature,
        top_p=top_p,
        repetition_penalty=repetition_penalty,
        no_repeat_ngram_size=no_repeat_ngram_size,
        max_new_tokens=max_new_tokens,
        seed=seed,
    )
    session = ChatSession(
        loaded.model,
        loaded.tokenizer,
        policy=make_policy(policy, cache_size),
        sampling=sampling,
        model_name=loaded.name,
    )
    rng = random.Random(seed)
    messages = user_turns(paragraphs(data, books), loaded.tokenizer, rng)
    keys = [
        "turn",
        "prompt_tokens",
        "generated_tokens",
        "stop_reason",
        "decode_tokens_per_second",
        "prompt_tokens_per_second",
        "rss_bytes",
        "cache_slots",
        "tokens_seen",
        "evicted",
        "elapsed_s",
        "load_1m",
    ]
    series = {k: [] for k in keys}
    start = time.perf_counter()
    turn = 0
    print(
        f"chat soak: {loaded.name}, {session.policy.describe()}, {describe_source(data)}, >= {turns} turns and "
        f">= {min_tokens} tokens",
        flush=True,
    )
    while turn < turns or session.stats()["tokens_seen"] < min_tokens:
        turn += 1
        result = session.chat(next(messages))
        stats = session.stats()
        row = {
            "turn": turn,
            "prompt_tokens": result.prompt_tokens,
            "generated_tokens": result.generated_tokens,
            "stop_reason": result.stop_reason,
            "decode_tokens_per_second": round(result.tokens_per_second, 3),
            "prompt_tokens_per_second": round(result.prompt_tokens_per_second, 2),
            "rss_bytes": rss_bytes(),
            "cache_slots": stats["cache_slots"],
            "tokens_seen": stats["tokens_seen"],
            "evicted": stats["evicted"],
            "elapsed_s": round(time.perf_counter() - start, 2),
            "load_1m": round(os.getloadavg()[0], 2),
        }
        for k in keys:
            series[k].append(row[k])
        if turn % 10 == 0 or turn <= 3:
            print(
                f"turn {turn:4d}: seen {row['tokens_seen']:6d}, prompt {row['prompt_tokens']:4d} tok, "
                f"reply {row['generated_tokens']:3d} tok at {row['decode_tokens_per_second']:5.1f} tok/s, "
                f"RSS {row['rss_bytes'] / 2**20:7.1f} MiB, cache {row['cache_slots']}/{cache_size}, "
                f"load {row['load_1m']}",
                flush=True,
            )

    speeds = series["decode_tokens_per_second"]
    rss = series["rss_bytes"]
    rss_ratio = rss[-1] / rss[9]
    speed_ratio = speeds[-1] / speeds[9]
    speed_window_ratio = statistics.median(speeds[-10:]) / statistics.median(speeds[9:19])
    summary = {
        "turns": turn,
        "tokens_seen": session.stats()["tokens_seen"],
        "prompt_tokens": session.prompt_tokens,
        "generated_tokens": session.generated_tokens,
        "policy": session.policy.describe(),
        "cache_size": cache_size,
        "max_cache_slots": max(series["cache_slots"]),
        "turns_longer_than_cache": sum(p > cache_size for p in series["prompt_tokens"]),
        "rss_after_turn_10_bytes": rss[9],
        "rss_last_bytes": rss[-1],
        "rss_max_bytes": max(rss[9:]),
        "rss_ratio_last_over_turn_10": round(rss_ratio, 4),
        "tokens_per_second_turn_10": speeds[9],
        "tokens_per_second_last": speeds[-1],
        "tokens_per_second_ratio_last_over_turn_10": round(speed_ratio, 4),
        "tokens_per_second_median_turns_10_19": statistics.median(speeds[9:19]),
        "tokens_per_second_median_last_10": statistics.median(speeds[-10:]),
        "tokens_per_second_ratio_median_last_10_over_turns_10_19": round(speed_window_ratio, 4),
        "wall_seconds": round(time.perf_counter() - start, 1),
    }
    summary["rss_flat"] = rss_ratio <= 1.05
    summary["cache_within_budget"] = summary["max_cache_slots"] <= cache_size
    result = {
        "benchmark": "chat_soak",
        "note": "load_1m in the series is the 1-minute load average after each turn (other jobs on the machine slow "
        "generation down)",
        "settings": {
            "model": loaded.name,
            "policy": policy,
            "cache_size": cache_size,
            "turns": turns,
            "min_tokens": min_tokens,
            "sampling": vars(sampling),
            "threads": threads,
            "chunk_size": session.chunk_size,
            "data": corpus_record(data),
            "books": books,
        },
        "corpus": describe_source(data),
        "environment": environment(),
        "summary": summary,
        "series": series,
    }
    write_result(out, result, plot_chat)
    print(
        f"RSS last / after turn 10: {rss_ratio:.4f} ({rss[-1] / 2**20:.1f} / {rss[9] / 2**20:.1f} MiB) "
        f"-> {'flat' if summary['rss_flat'] else 'GREW'}"
    )
    print(
        f"tok/s last / turn 10: {speed_ratio:.3f} ({speeds[-1]:.2f} / {speeds[9]:.2f}); median of last 10 / "
        f"median of turns 10-19: {speed_window_ratio:.3f}"
    )
    print(
        f"{turn} turns, {summary['tokens_seen']} tokens, max cache occupancy {summary['max_cache_slots']}/{cache_size}"
    )
