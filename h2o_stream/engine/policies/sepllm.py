"""`sepllm` — SepLLM (Chen et al. 2024, arXiv 2412.12094, "SepLLM: Accelerate Large Language Models by Compressing
One Segment into One Separator"), its streaming setting.

Keep the stream's first `sinks` tokens, the last `recent` entries, and among the others the `separators` most
recent separator tokens; while fewer separators than that are held, the spare slots keep the most recent other
entries. Needs no attention scores (the fused attention path stays). The same choice for every KV head.

Separators are SepLLM's (. , ? ! ; : space, tab, newline), found in the model's tokenizer: every token that is not a
special token and decodes to a non-empty text made only of those punctuation marks and whitespace. So the policy
needs the tokenizer (make_policy(..., tokenizer=...)) and forwards that bring token ids.

Default split: 4 sinks, a fifth of the cache separators, the rest recent (SepLLM's streaming runs use 4 + 64 + 256).
"""

from __future__ import annotations

from dataclasses import dataclass

from h2o_stream.errors import H2OStreamError

from .base import RECENT, SINKS, EvictionPolicy, Part
from .ranking import TOKEN_CLASS
from .registry import register

#: SepLLM's separators: a token made only of these (and at least one of them) is a separator
SEPARATOR_PUNCTUATION = ".,?!;:"


def separator_ids(tokenizer) -> tuple[int, ...]:
    """Ids of the tokenizer's separator tokens (see the module docstring), ascending."""
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]
    texts = tokenizer.batch_decode([[i] for i in ids], clean_up_tokenization_spaces=False)
    return tuple(
        i
        for i, text in zip(ids, texts, strict=True)
        if text and all(c in SEPARATOR_PUNCTUATION or c.isspace() for c in text)
    )


@register
@dataclass
class SepLLMPolicy(EvictionPolicy):
    sinks: int
    separators: int
    recent: int
    separator_ids: tuple[int, ...]
    name = "sepllm"
    parts = (
        SINKS,
        Part("separators", "separator-token slots, the most recent punctuation/newline tokens", share=0.2),
        RECENT,
    )
    ranking = TOKEN_CLASS  # separators above the rest, newer above older within each

    def __post_init__(self):
        super().__post_init__()
        if not self.separator_ids or not all(isinstance(i, int) and i >= 0 for i in self.separator_ids):
            raise H2OStreamError(
                "sepllm needs the token ids of its separators; the tokenizer has no separator "
                "tokens (punctuation, whitespace)"
                if not self.separator_ids
                else f"separator ids must be token ids, got {self.separator_ids!r}"
            )
        self.separator_ids = tuple(sorted(set(self.separator_ids)))

    @classmethod
    def tokenizer_settings(cls, tokenizer) -> dict:
        return {"separator_ids": separator_ids(tokenizer)}

    def describe(self) -> str:
        return (
            f"{self.name}(sinks={self.sinks}, separators={self.separators}, recent={self.recent}; "
            f"{len(self.separator_ids)} separator tokens)"
        )

    def settings(self) -> dict:
        return {**super().settings(), "separator_ids": list(self.separator_ids)}  # as JSON stores it
