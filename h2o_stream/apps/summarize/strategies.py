"""The two ways to read a document longer than the cache.

- ``single``: the whole document is fed, `chunk_size` tokens per forward, into one `StreamingCache`; then the
  instruction is given and the summary generated from whatever the policy kept.
- ``hierarchical``: the document is cut into sections of `size` tokens; each section is read into a fresh cache and
  summarized; the section summaries are then combined (in groups, level by level, until they fit in one section) and
  summarized with the instruction.
"""

from __future__ import annotations

import time

from .prompts import SUMMARIES_PREAMBLE, build_prompt, encode
from .reader import Reader
from .results import SectionSummary


def single(reader: Reader, ids: list[int], instruction: str, max_new_tokens: int, report=None, on_text=None) -> str:
    """The whole document through one cache, then the instruction; the summary."""
    text, _ = reader.answer(ids, build_prompt(reader.tokenizer, instruction), max_new_tokens, report, on_text)
    return text


def hierarchical(
    reader: Reader,
    ids: list[int],
    size: int,
    instruction: str,
    max_new_tokens: int,
    section_instruction: str,
    section_max_new_tokens: int,
    report,
    on_text,
    on_section,
    sections: list[SectionSummary],
) -> str:
    """Sections of `size` tokens summarized one by one, then their summaries (appended to `sections`, and passed to
    `on_section`, as they are made) combined level by level; the final summary."""
    tokenizer = reader.tokenizer
    if len(ids) <= size:
        # One section: its summary would only be summarized again; answer the real instruction directly instead.
        return single(reader, ids, instruction, max_new_tokens, report, on_text)
    section_prompt = build_prompt(tokenizer, section_instruction)
    combine_prompt = build_prompt(tokenizer, section_instruction, preamble=SUMMARIES_PREAMBLE)
    final_prompt = build_prompt(tokenizer, instruction, preamble=SUMMARIES_PREAMBLE)

    # Level 0: the document, section by section.
    summaries: list[str] = []
    for index, start in enumerate(range(0, len(ids), size)):
        piece = ids[start : start + size]
        progress = (lambda done, base=start: report(base + done)) if report is not None else None
        summaries.append(
            _section(
                reader, piece, section_prompt, section_max_new_tokens, 0, index, start, progress, on_section, sections
            )
        )
    # Levels 1+: combine groups of consecutive summaries until they fit in one section.
    level = 0
    while True:
        pieces = [encode(tokenizer, _numbered(i, s)) for i, s in enumerate(summaries)]
        if sum(len(p) for p in pieces) <= size:
            break
        groups = _groups(pieces, size)
        if len(groups) >= len(summaries):  # no group holds two summaries: nothing left to gain by combining
            break
        level += 1
        combined, offset = [], 0
        for index, group in enumerate(groups):
            group_ids = [t for p in group for t in p]
            combined.append(
                _section(
                    reader,
                    group_ids,
                    combine_prompt,
                    section_max_new_tokens,
                    level,
                    index,
                    offset,
                    None,
                    on_section,
                    sections,
                )
            )
            offset += len(group_ids)
        summaries = combined
    joined = [t for i, s in enumerate(summaries) for t in encode(tokenizer, _numbered(i, s))]
    text, _ = reader.answer(joined, final_prompt, max_new_tokens, None, on_text)
    return text


def _section(reader, piece, prompt, max_new_tokens, level, index, start, progress, on_section, sections) -> str:
    began = time.perf_counter()
    text, evicted = reader.answer(piece, prompt, max_new_tokens, progress)
    section = SectionSummary(
        level=level,
        index=index,
        start=start,
        end=start + len(piece),
        text=text,
        evictions=evicted,
        seconds=time.perf_counter() - began,
    )
    sections.append(section)
    if on_section is not None:
        on_section(section)
    return text


def _numbered(index: int, summary: str) -> str:
    separator = "" if index == 0 else "\n\n"
    return f"{separator}Part {index + 1}: {summary or '(no summary)'}"


def _groups(pieces: list[list[int]], size: int) -> list[list[list[int]]]:
    groups: list[list[list[int]]] = [[]]
    length = 0
    for piece in pieces:
        if groups[-1] and length + len(piece) > size:
            groups.append([])
            length = 0
        groups[-1].append(piece)
        length += len(piece)
    return groups
