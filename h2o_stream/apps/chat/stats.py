"""What a chat turn and a chat session report (tokens, cache occupancy, evictions, speed, memory), and the text
the REPL shows for them."""

from __future__ import annotations

from dataclasses import dataclass, field

#: TurnResult.stop_reason values: the reply ended itself (end-of-turn token or stop text), hit max_new_tokens, was
#: stopped by the user while generated (kept), was cancelled while the message was read (the turn is undone), or
#: was given rather than generated (`ChatSession.replay`)
TURN_STOP_REASONS = ("end", "length", "interrupted", "cancelled", "replayed")


@dataclass
class TurnResult:
    """One turn: the reply and its counters."""

    text: str  # the reply as shown (special tokens skipped, cut before a stop text, leading whitespace dropped)
    prompt_tokens: int  # template + user tokens fed for this turn, end-of-message tokens included
    generated_tokens: int  # reply tokens sampled and kept
    stop_reason: str  # one of TURN_STOP_REASONS
    prompt_seconds: float
    generate_seconds: float
    token_ids: list[int] = field(default_factory=list)  # the reply's tokens (stop token excluded)

    @property
    def tokens_per_second(self) -> float:
        """Generation speed of this turn (sampled tokens per second of decoding)."""
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        """Speed at which this turn's message was read."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0


def rss_bytes() -> int:
    """Resident memory of this process (psutil), or 0 where it cannot be read."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except Exception:  # noqa: BLE001 - memory is a statistic: no reading of it may stop a chat
        return 0


def session_stats(session) -> dict:
    """Counters of a ChatSession for people and benchmarks: tokens, cache occupancy, evictions, speed, memory."""
    cache = session.cache
    slots = max(layer.slots for layer in cache.layers)
    cache_bytes = sum(
        t.numel() * t.element_size()
        for layer in cache.layers
        for t in (layer.keys, layer.values, layer.positions, layer.scores)
        if t is not None
    )
    last = session.last_turn
    return {
        "turns": session.turns,
        "tokens_seen": cache.seen,
        "prompt_tokens": session.prompt_tokens,
        "generated_tokens": session.generated_tokens,
        "cache_slots": slots,
        "cache_budget": cache.policy.budget,
        "policy": cache.policy.describe(),
        "evicted": cache.evicted,
        "cache_bytes": cache_bytes,
        "last_tokens_per_second": last.tokens_per_second if last else 0.0,
        "last_prompt_tokens_per_second": last.prompt_tokens_per_second if last else 0.0,
        "tokens_per_second": session.generated_tokens / session.generate_seconds if session.generate_seconds else 0.0,
        "rss_bytes": rss_bytes(),
    }


def format_stats(stats: dict) -> str:
    """`session_stats` as the lines /stats prints."""
    budget = stats["cache_budget"]
    occupancy = f"{stats['cache_slots']}/{budget if budget is not None else 'unbounded'}"
    return "\n".join(
        [
            f"turns:           {stats['turns']}",
            f"tokens seen:     {stats['tokens_seen']} (prompt {stats['prompt_tokens']}, "
            f"generated {stats['generated_tokens']})",
            f"cache occupancy: {occupancy} entries per layer and KV head, {stats['policy']}, "
            f"{size_text(stats['cache_bytes'])}",
            f"evictions:       {stats['evicted']} entries (all layers and KV heads)",
            f"speed:           last reply {stats['last_tokens_per_second']:.1f} tok/s, its prompt "
            f"{stats['last_prompt_tokens_per_second']:.0f} tok/s; session {stats['tokens_per_second']:.1f} tok/s",
            f"memory:          RSS {size_text(stats['rss_bytes'])}",
        ]
    )


def cache_settings(session) -> str:
    """The session's cache as the user set it: policy, budget split and rolling, e.g. "h2o(heavy=4, recent=4)"."""
    return session.policy.describe() + ("" if session.cache.rolling else ", no rolling")


def loaded_summary(session, path) -> str:
    """What a resumed session holds, said once after /load or --load."""
    stats = session.stats()
    sampling = session.sampling
    text = (
        f"resumed the session from {path}: {stats['turns']} turn(s), {stats['tokens_seen']} tokens seen, "
        f"{stats['policy']}, temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, "
        f"repetition-penalty {sampling.repetition_penalty:g}, max-new-tokens {sampling.max_new_tokens}"
    )
    if session.system:
        text += f", system prompt {clip(session.system)!r}"
    recent = session.recent_messages
    if recent:
        text += f"\nlast reply: {clip(recent[-1]['content'], 200)}"
    return text


def clip(text: str, limit: int = 60) -> str:
    """`text` on one line, cut to `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def size_text(n: int) -> str:
    """Bytes as MiB, one decimal."""
    return f"{n / 2**20:.1f} MiB"
