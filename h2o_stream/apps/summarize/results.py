"""What summarize() returns: the summary, its statistics and, for the hierarchical strategy, every section summary."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SectionSummary:
    """One intermediate summary of the hierarchical strategy."""

    level: int  # 0: a section of the document; 1+: a group of summaries of the level below
    index: int
    start: int  # token range [start, end) of this level's input (level 0: of the document)
    end: int
    text: str
    evictions: int
    seconds: float


@dataclass
class SummaryResult:
    """The summary and how it was made."""

    text: str
    tokens_read: int  # document tokens (each read once)
    evictions: int  # cache entries evicted, summed over every layer and KV head of every cache used
    seconds: float
    strategy: str
    policy: dict  # the policy's settings, e.g. {"policy": "h2o", "heavy": 512, "recent": 512}
    cache_size: int | None
    chunk_size: int
    rolling: bool
    tokens_generated: int  # every generated token (section summaries included)
    tokens_fed: int  # every token that went through the model: prompts, document, section summaries
    peak_slots: int  # the most entries per layer and KV head any cache held between forwards
    read_seconds: float
    generate_seconds: float
    title: str | None = None
    source: str | None = None
    model: str | None = None
    chat_template: bool = False
    sections: list[SectionSummary] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # how tokens were chosen (temperature, seed, repetition controls)
    stop_reason: str = ""  # why the summary ended: "eos" (the model ended it) or "length" (max_new_tokens)

    @property
    def tokens_per_second(self) -> float:
        """Tokens fed per second of reading."""
        return self.tokens_fed / self.read_seconds if self.read_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        """A JSON-ready dict of every field."""
        return asdict(self)
