"""`python -m eval soak defaults`: do summarize's decoding defaults, and the chat's, stop the default model from
looping? Before the generation layer, `h2o-stream summarize` decoded greedily with no repetition control, and on 80k
characters of Moby-Dick (cache 256) it wrote one sentence over and over until the token limit. This summarizes the
first `--chars` characters of each of `--books` twice through the same cache (h2o, `--cache-size`): with those old
settings and with summarize's current defaults, then has a few chat turns with `ChatSession`'s defaults. For every
output it records the text, why it ended ("eos" or "length") and the distinct-4-gram ratio: distinct word 4-grams /
all word 4-grams (1.0 = no 4 words repeated; a reply looping on one sentence falls towards 0). Words are lower-cased
runs of letters/digits, and each punctuation mark is a word of its own. Caveat: the new summarize defaults include
transformers' no-repeat-n-gram rule (no 4 *tokens* twice), so their ratio is close to 1 by construction; the ratio
shows the loop is gone, the texts show whether what replaced it reads well. Nothing was tuned on these numbers: the
defaults were chosen first, then measured once.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict
from pathlib import Path

import click

from eval.common import (
    RESULTS,
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
from h2o_stream.apps.chat import ChatSession
from h2o_stream.loading.corpus import describe_source, read_book

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


@click.command()
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
