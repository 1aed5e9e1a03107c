"""What the summarize tests share: the tiny tokenizer's training texts, random-word documents, a forward hook that
watches the cache budget, and a summarize() call with small settings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerFast

from h2o_stream.apps.summarize import SummaryResult, summarize
from support.tiny_models import SMOLLM2_TEMPLATE, bpe_tokenizer

WORDS = [
    "the",
    "whale",
    "ship",
    "captain",
    "sea",
    "storm",
    "harbour",
    "night",
    "morning",
    "letter",
    "house",
    "garden",
    "sister",
    "brother",
    "mother",
    "father",
    "journey",
    "river",
    "road",
    "king",
    "queen",
    "soldier",
    "war",
    "peace",
    "money",
    "dinner",
    "ball",
    "dance",
    "town",
    "country",
    "church",
]
#: what conftest's `tokenizer` fixture trains on in every summarize test module
TRAINING_TEXTS = [
    " ".join(WORDS),
    "Here is a document: Summarize the document above in a few sentences.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "user assistant system",
    "Here are summaries of consecutive parts of a document, in order: Part 1: 2: 3:",
]

#: three PG-19 rows: two titles share "mm", one title ("Emma") is also part of another
BOOKS = [
    {"short_book_title": "Moby Dick", "publication_date": 1851, "url": "u1", "text": "Call me Ishmael. " * 20},
    {"short_book_title": "Emma", "publication_date": 1815, "url": "u2", "text": "Emma Woodhouse. " * 20},
    {"short_book_title": "Emma Returns", "publication_date": 1900, "url": "u3", "text": "Again. " * 20},
]


def jsonl(path: Path, rows) -> Path:
    """`rows` as a .jsonl file at `path`."""
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def tiny_tokenizer(template: str | None = SMOLLM2_TEMPLATE) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(TRAINING_TEXTS, template)


def words(count: int, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (count,), generator=generator).tolist()
    sentences = [" ".join(WORDS[i] for i in picks[k : k + 12]).capitalize() + "." for k in range(0, count, 12)]
    return " ".join(sentences)


class BudgetWatch:
    """Records, after every forward pass that carries a StreamingCache, the entries each layer holds (all of them
    must be <= the budget between forwards) and the largest key count attention saw during one."""

    def __init__(self, model):
        self.after: list[int] = []
        self.budgets: set = set()
        self.caches: list = []
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output):
        cache = kwargs.get("cache")
        if cache is None:
            return
        if not any(cache is c for c in self.caches):
            self.caches.append(cache)
        self.budgets.add(cache.policy.budget)
        self.after.append(max(layer.slots for layer in cache.layers))

    def close(self):
        self.handle.remove()


def run(model, tokenizer, text, **kwargs) -> tuple[SummaryResult, BudgetWatch]:
    """summarize() with a 48-entry h2o cache, chunks of 16 and at most 6 new tokens unless `kwargs` say otherwise."""
    watch = BudgetWatch(model)
    try:
        kwargs = {"policy": "h2o", "cache_size": 48, "chunk_size": 16, "max_new_tokens": 6, **kwargs}
        return summarize(text, (model, tokenizer), **kwargs), watch
    finally:
        watch.close()
