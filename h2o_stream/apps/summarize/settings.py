"""Summarize's defaults and the checks every entry point (summarize(), the command) runs before any work."""

from __future__ import annotations

from h2o_stream.engine.policies import make_policy, policy_class
from h2o_stream.errors import H2OStreamError, option_name

STRATEGIES = ("single", "hierarchical")
DEFAULT_POLICY = "h2o"
DEFAULT_CACHE_SIZE = 1024
DEFAULT_CHUNK_SIZE = 256
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SECTION_MAX_NEW_TOKENS = 96
DEFAULT_INSTRUCTION = "Summarize the document above in a few sentences."
DEFAULT_SECTION_INSTRUCTION = "Summarize this part of a longer document in two or three sentences."
# Decoding: greedy, so a summary is repeatable, with transformers' two repetition controls, because the small default
# model decoded greedily without them repeats one sentence until the token limit
# (eval/results/soak/generation_defaults.json):
# CTRL's penalty of 1.2 on tokens already in the summary, and no 4 tokens twice in the same order.
DEFAULT_TEMPERATURE = 0.0
DEFAULT_TOP_P = 0.9  # used only when sampling (temperature > 0)
DEFAULT_REPETITION_PENALTY = 1.2
DEFAULT_NO_REPEAT_NGRAM_SIZE = 4


def check_settings(
    *,
    strategy: str,
    instruction,
    max_new_tokens,
    policy: str,
    cache_size,
    chunk_size=DEFAULT_CHUNK_SIZE,
    section_tokens=None,
    section_max_new_tokens=DEFAULT_SECTION_MAX_NEW_TOKENS,
    section_instruction=DEFAULT_SECTION_INSTRUCTION,
    options: bool = False,
    parts: dict | None = None,
) -> tuple[str, int, str]:
    """Refuse bad settings with one clear message; (instruction, max_new_tokens, section_instruction) cleaned.
    `parts`: the policy's budget parts and settings, as `make_policy` takes them (a dict, not keywords: a part
    named `options` is then an unknown part, not this flag). `options`: name the settings as the command's options
    (--max-new-tokens), not as summarize()'s arguments (max_new_tokens)."""
    name = option_name if options else str
    if strategy not in STRATEGIES:
        raise H2OStreamError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    instruction = nonempty(name("instruction"), instruction)
    max_new_tokens = positive_int(name("max_new_tokens"), max_new_tokens)
    if strategy == "hierarchical":
        section_instruction = nonempty(name("section_instruction"), section_instruction)
        positive_int(name("section_max_new_tokens"), section_max_new_tokens)
        if section_tokens is not None:
            positive_int(name("section_tokens"), section_tokens)
    if not policy_class(policy).needs_tokenizer:  # those that need one are built (and checked) by the Reader
        make_policy(policy, cache_size, **(parts or {}))  # raises on a bad policy setting
    positive_int(name("chunk_size"), chunk_size)
    return instruction, max_new_tokens, section_instruction


def nonempty(name: str, value) -> str:
    """`value` stripped; an error naming `name` if it is not a non-blank string."""
    if not isinstance(value, str) or not value.strip():
        raise H2OStreamError(f"{name} is empty: say what the summary should be (e.g. {DEFAULT_INSTRUCTION!r})")
    return value.strip()


def positive_int(name: str, value) -> int:
    """`value` if it is a whole number >= 1 (not a bool); else an error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise H2OStreamError(f"{name} must be a whole number >= 1, got {value!r}")
    if value <= 0:
        raise H2OStreamError(f"{name} must be >= 1, got {value}")
    return value
