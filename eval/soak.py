"""Soak: long chats and generated text, on the default model.

chat: `ChatSession` over hundreds of turns in one session, memory and speed sampled after every turn. The claim under
test: with a fixed-size cache the chat's memory never grows and its speed does not degrade, however long the
conversation. User turns are passages from a corpus (`--data`; lengths varied, some alone longer than the cache) with a
short instruction; replies are sampled with the chat's settings. Pass criteria: RSS after the last turn <= 1.05 x RSS
after turn 10, and generation speed flat (last / turn 10; since a single turn's speed is noisy on a shared machine,
the median of the last 10 turns over the median of turns 10-19 is reported too).

defaults: do summarize's decoding defaults, and the chat's, stop the default model from looping? Before the generation
layer, `h2o-stream summarize` decoded greedily with no repetition control, and on 80k characters of Moby-Dick (cache
256) it wrote one sentence over and over until the token limit. This summarizes the first `--chars` characters of each
of `--books` twice through the same cache (h2o, `--cache-size`): with those old settings and with summarize's current
defaults, then has a few chat turns with `ChatSession`'s defaults. For every output it records the text, why it ended
("eos" or "length") and the distinct-4-gram ratio: distinct word 4-grams / all word 4-grams (1.0 = no 4 words
repeated; a reply looping on one sentence falls towards 0). Words are lower-cased runs of letters/digits, and each
punctuation mark is a word of its own. Caveat: the new summarize defaults include transformers' no-repeat-n-gram rule
(no 4 *tokens* twice), so their ratio is close to 1 by construction; the ratio shows the loop is gone, the texts show
whether what replaced it reads well. Nothing was tuned on these numbers: the defaults were chosen first, then measured
once.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import click
import torch

from eval.common import (
    RESULTS,
    corpus_record,
    data_option,
    environment,
    load_model,
    model_option,
    new_figure,
    save_figure,
    setup,
    write_result,
)
from h2o_stream import __version__
from h2o_stream.apps.chat import CHAT_SAMPLING, ChatSession
from h2o_stream.generation import Sampling
from h2o_stream.loading.corpus import describe_source, iter_books, read_book


@click.group()
def soak():
    """Long chats and generated text (parts: chat, defaults)."""


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


#: the decoding `h2o-stream summarize` used before the generation layer
OLD_SUMMARIZE = {"temperature": 0.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
CHAT_MESSAGES = [
    "Hello! What can you tell me about whales?",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What is the story of Frankenstein about?",
    "Give me three tips for learning to cook.",
]


def distinct_4(text: str) -> float | None:
    """Distinct word 4-grams / all word 4-grams of `text`; None when it has fewer than 4 words."""
    words = re.findall(r"\w+|[^\w\s]", text.lower())
    grams = [tuple(words[i : i + 4]) for i in range(len(words) - 3)]
    return len(set(grams)) / len(grams) if grams else None


def summary_row(book: str, setting: str, result) -> dict:
    return {
        "book": book,
        "setting": setting,
        "distinct_4": distinct_4(result.text),
        "text": result.text,
        "stop_reason": result.stop_reason,
        "tokens_generated": result.tokens_generated,
        "tokens_read": result.tokens_read,
        "sampling": result.sampling,
        "seconds": round(result.seconds, 1),
    }


@soak.command()
@data_option
@click.option(
    "--books",
    default="Pride and Prejudice,Moby Dick,Frankenstein",
    show_default=True,
    help="Comma-separated titles (or parts of titles) in --data.",
)
@click.option("--chars", default=80_000, show_default=True, help="Characters from the start of each book.")
@click.option("--cache-size", default=256, show_default=True)
@click.option("--chunk-size", default=256, show_default=True)
@click.option("--max-new-tokens", default=256, show_default=True, help="Summary length limit (both settings).")
@click.option("--chat-turns", default=len(CHAT_MESSAGES), show_default=True)
@click.option("--threads", default=1, show_default=True)
@model_option
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=RESULTS / "soak" / "generation_defaults.json",
    show_default=True,
    help="JSON path; the PNG goes beside it.",
)
def defaults(data, books, chars, cache_size, chunk_size, max_new_tokens, chat_turns, threads, model_spec, out):
    """Summaries and chat replies with the old and the current decoding defaults: soak/generation_defaults.json."""
    from h2o_stream.apps.summarize import settings as summarize_settings
    from h2o_stream.apps.summarize import summarize

    setup(threads)
    loaded = load_model(model_spec, threads=threads)
    started = time.perf_counter()
    common = {"policy": "h2o", "cache_size": cache_size, "chunk_size": chunk_size, "max_new_tokens": max_new_tokens}
    new_defaults = {
        "temperature": summarize_settings.DEFAULT_TEMPERATURE,
        "top_p": summarize_settings.DEFAULT_TOP_P,
        "repetition_penalty": summarize_settings.DEFAULT_REPETITION_PENALTY,
        "no_repeat_ngram_size": summarize_settings.DEFAULT_NO_REPEAT_NGRAM_SIZE,
    }
    summaries = []
    for title in (t.strip() for t in books.split(",")):
        _, book = read_book(data, title)
        document = book.text[:chars]
        for setting, decoding in (("old", OLD_SUMMARIZE), ("new defaults", {})):
            result = summarize(document, loaded, **common, **decoding)
            summaries.append({**summary_row(book.title, setting, result), "chars": len(document)})
            print(
                f"{book.title} [{setting}] d4={summaries[-1]['distinct_4']} {result.stop_reason} "
                f"{result.tokens_generated} tok, {result.seconds:.0f} s: {result.text[:160]!r}",
                flush=True,
            )

    session = ChatSession(loaded.model, loaded.tokenizer, model_name=loaded.name)  # every chat default
    replies = []
    for message in CHAT_MESSAGES[:chat_turns]:
        turn = session.chat(message)
        replies.append(
            {
                "message": message,
                "text": turn.text,
                "distinct_4": distinct_4(turn.text),
                "stop_reason": turn.stop_reason,
                "tokens_generated": turn.generated_tokens,
            }
        )
        print(f"chat d4={replies[-1]['distinct_4']} {turn.stop_reason}: {turn.text[:160]!r}", flush=True)

    result = {
        "description": "Readable defaults: do summarize's decoding defaults, and the chat's, stop the default model "
        "from looping?",
        "data": describe_source(data),
        "model": loaded.name,
        "h2o_stream": __version__,
        "settings": {
            "books": books,
            "chars": chars,
            **common,
            "old_summarize": OLD_SUMMARIZE,
            "new_summarize_defaults": new_defaults,
            "chat_defaults": asdict(session.sampling),
            "chat_cache": session.policy.settings(),
            "distinct_4": "distinct word 4-grams / all word 4-grams (lower-cased \\w+ runs and punctuation)",
        },
        "summaries": summaries,
        "chat": replies,
        "seconds": round(time.perf_counter() - started, 1),
        "environment": environment(),
    }
    write_result(out, result, plot_defaults)


def plot_defaults(result: dict, path) -> None:
    """Distinct-4 ratio of each summary (old vs new defaults, per book) and of each chat reply."""
    fig, (left, right) = new_figure(1, 2, size=(10, 3.6))
    books = list(dict.fromkeys(row["book"] for row in result["summaries"]))
    width = 0.38
    for k, setting in enumerate(("old", "new defaults")):
        values = [
            next((r["distinct_4"] or 0 for r in result["summaries"] if r["book"] == b and r["setting"] == setting), 0)
            for b in books
        ]
        left.bar([i + (k - 0.5) * width for i in range(len(books))], values, width, label=setting)
    left.set_xticks(range(len(books)), [b[:22] for b in books], fontsize=8)
    left.set_ylim(0, 1.05)
    left.set_ylabel("distinct 4-gram ratio")
    left.set_title(
        f"summaries ({result['settings']['chars']:,} chars, cache {result['settings']['cache_size']})", fontsize=9
    )
    left.legend(fontsize=8)
    right.bar(range(len(result["chat"])), [t["distinct_4"] or 0 for t in result["chat"]], color="tab:green")
    right.set_xticks(range(len(result["chat"])), [f"turn {i + 1}" for i in range(len(result["chat"]))], fontsize=8)
    right.set_ylim(0, 1.05)
    right.set_title("chat replies (ChatSession defaults)", fontsize=9)
    save_figure(fig, path, f"{result['model']}: repetition in generated text (1.0 = no word 4-gram repeated)")
