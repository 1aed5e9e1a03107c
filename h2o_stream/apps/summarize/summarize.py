"""Long-document summarization: stream a document far longer than the model's context through a fixed-budget cache,
then generate.

Two strategies share one API (`strategy=`):

- ``single``: the whole document is fed, `chunk_size` tokens per forward, into one `StreamingCache`; then the
  instruction is given and the summary generated from whatever the policy kept.
- ``hierarchical``: the document is cut into sections of `section_tokens` tokens; each section is read into a fresh
  cache and summarized; the section summaries are then combined (in groups, level by level, until they fit in one
  section) and summarized with the instruction.

Prompting: with a chat template, the document is the start of a user turn ("Here is a document:\\n" + document) and
the instruction ends that same turn, so the model reads the instruction last, right before the assistant header.
Without a chat template a plain "Document: ... Instruction: ... Answer:" prompt is used. The document is tokenized
on its own with special-token strings split (a document cannot inject "<|im_end|>"), so `tokens_read` is exactly the
document's token count.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.errors import H2OStreamError
from h2o_stream.engine.policies import make_policy
from h2o_stream.engine.feed import feed

STRATEGIES = ("single", "hierarchical")
DEFAULT_POLICY = "h2o"
DEFAULT_CACHE_SIZE = 1024
DEFAULT_CHUNK_SIZE = 256
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_SECTION_MAX_NEW_TOKENS = 96
DEFAULT_INSTRUCTION = "Summarize the document above in a few sentences."
DEFAULT_SECTION_INSTRUCTION = "Summarize this part of a longer document in two or three sentences."
DOCUMENT_PREAMBLE = "Here is a document:\n"
SUMMARIES_PREAMBLE = "Here are summaries of consecutive parts of a document, in order:\n"
TEXT_SUFFIXES = (".txt", ".md", ".markdown", ".text", ".rst")
JSONL_SUFFIXES = (".jsonl",)
_PATH_LIKE_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + (".json", ".gz", ".pdf")
_CHAT_PLACEHOLDER = "\x00H2O_STREAM_DOCUMENT\x00"


# --- documents ---------------------------------------------------------------------------------------------------


@dataclass
class Document:
    text: str
    title: str | None = None
    source: str | None = None  # the file it came from (None for text passed directly)


def load_document(source: str | os.PathLike, *, book: int | str | None = None) -> Document:
    """A document from a file: UTF-8 text (.txt, .md, ...) or a PG-19 style .jsonl (one book per row, columns
    short_book_title and text; `book` picks the row by index or title)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise H2OStreamError(f"file not found: {path}")
    if path.is_dir():
        raise H2OStreamError(f"{path} is a directory: pass a text, .md or PG-19 .jsonl file")
    try:
        data = path.read_bytes()
    except OSError as error:
        raise H2OStreamError(f"cannot read {path}: {error.strerror or error}") from None
    text = _decode_text(data, path)
    if path.suffix.lower() in JSONL_SUFFIXES:
        return _pick_book(text, path, book)
    if book is not None:
        raise H2OStreamError(f"book={book!r} only applies to a PG-19 .jsonl file, not to {path.name}")
    _require_text(text, str(path))
    return Document(text=text, title=path.stem, source=str(path))


def list_books(path: str | os.PathLike) -> list[tuple[int, str]]:
    """(index, title) of every row of a PG-19 style .jsonl file."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise H2OStreamError(f"file not found: {path}")
    return [(i, title) for i, (title, _) in enumerate(_jsonl_rows(_decode_text(path.read_bytes(), path), path))]


def _decode_text(data: bytes, path: Path) -> str:
    if b"\x00" in data:
        raise H2OStreamError(f"{path} looks like a binary file (it contains NUL bytes): "
                             "pass a UTF-8 text, .md or PG-19 .jsonl file")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise H2OStreamError(f"{path} is not UTF-8 text (byte 0x{data[error.start]:02x} at offset {error.start}): "
                             "pass a UTF-8 text, .md or PG-19 .jsonl file") from None


def _require_text(text: str, label: str) -> None:
    if not text.strip():
        raise H2OStreamError(f"{label} is empty: there is nothing to summarize")


def _jsonl_rows(text: str, path: Path):
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise H2OStreamError(f"{path} line {number} is not valid JSON ({error.msg}): "
                                 "expected one PG-19 row (short_book_title, text) per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            raise H2OStreamError(f"{path} line {number} has no 'text' column: expected PG-19 rows "
                                 "(short_book_title, publication_date, url, text)")
        title = row.get("short_book_title") or row.get("title") or f"row {number}"
        yield str(title), row


def _pick_book(text: str, path: Path, book: int | str | None) -> Document:
    rows = [(i, title, row) for i, (title, row) in enumerate(_jsonl_rows(text, path))]
    if not rows:
        raise H2OStreamError(f"{path} is empty: it has no PG-19 rows")
    examples = ", ".join(f"{i}: {title!r}" for i, title, _ in rows[:5]) + (", ..." if len(rows) > 5 else "")
    if book is None:
        if len(rows) > 1:
            raise H2OStreamError(f"{path} holds {len(rows)} books: choose one by index or title "
                                 f"(--book / book=), e.g. {examples}")
        chosen = rows[0]
    else:
        chosen = _match_book(rows, book)
        if chosen is None:
            raise H2OStreamError(f"no book {book!r} in {path} ({len(rows)} books, indices 0-{len(rows) - 1}): "
                                 f"e.g. {examples}")
    index, title, row = chosen
    _require_text(row["text"], f"book {index} ({title!r}) of {path}")
    return Document(text=row["text"], title=title, source=f"{path}#{index}")


def _match_book(rows, book):
    key = str(book).strip()
    if isinstance(book, int) or key.lstrip("-").isdigit():
        index = int(key)
        return rows[index] if 0 <= index < len(rows) else None
    lowered = key.lower()
    exact = [r for r in rows if r[1].lower() == lowered]
    if exact:
        return exact[0]
    partial = [r for r in rows if lowered and lowered in r[1].lower()]
    if len(partial) > 1:
        names = ", ".join(repr(r[1]) for r in partial[:5])
        raise H2OStreamError(f"book {book!r} matches {len(partial)} titles ({names}): be more specific")
    return partial[0] if partial else None


def as_document(text_or_path, *, book=None) -> Document:
    """A Path or an existing file name is read as a file; a one-line string that ends like a file name is taken for a
    missing file; any other string is the document's text."""
    if isinstance(text_or_path, Document):
        _require_text(text_or_path.text, "the document")
        return text_or_path
    if isinstance(text_or_path, os.PathLike):
        return load_document(text_or_path, book=book)
    if not isinstance(text_or_path, str):
        raise H2OStreamError(f"expected the document's text or a file path, got {type(text_or_path).__name__}")
    looks_like_path = ("\n" not in text_or_path and len(text_or_path) < 4096
                       and (_is_file(text_or_path) or text_or_path.strip().lower().endswith(_PATH_LIKE_SUFFIXES)))
    if looks_like_path:
        return load_document(text_or_path.strip(), book=book)
    if book is not None:
        raise H2OStreamError("book= only applies to a PG-19 .jsonl file, not to text")
    _require_text(text_or_path, "the document")
    return Document(text=text_or_path)


def _is_file(name: str) -> bool:
    try:
        return Path(name.strip()).expanduser().is_file()
    except (OSError, ValueError):
        return False


# --- prompts -----------------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """Token ids around the document: prefix + document + suffix (+ response prefix), then generation."""
    prefix: list[int]
    suffix: list[int]
    chat: bool  # whether the tokenizer's chat template was used


def encode(tokenizer, text: str) -> list[int]:
    """`text` as plain content: no special tokens added, special-token strings inside it split like any text."""
    try:
        return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False).input_ids)
    except TypeError:  # a tokenizer without split_special_tokens
        return list(tokenizer(text, add_special_tokens=False).input_ids)


def build_prompt(tokenizer, instruction: str, *, preamble: str = DOCUMENT_PREAMBLE,
                 response_prefix: str = "") -> Prompt:
    """The chat template (if any) rendered around a placeholder document and split there."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        content = f"{preamble}{_CHAT_PLACEHOLDER}\n\n{instruction}"
        try:
            rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                     add_generation_prompt=True)
        except Exception:  # a template that refuses our message (jinja raises anything): use the plain prompt
            rendered = None
        if isinstance(rendered, str) and rendered.count(_CHAT_PLACEHOLDER) == 1:
            head, tail = rendered.split(_CHAT_PLACEHOLDER)
            # Templates put the BOS text in themselves, so nothing is added when tokenizing them.
            prefix = list(tokenizer(head, add_special_tokens=False).input_ids)
            suffix = list(tokenizer(tail + response_prefix, add_special_tokens=False).input_ids)
            return Prompt(prefix=prefix, suffix=suffix, chat=True)
    head = "Document:\n" if preamble == DOCUMENT_PREAMBLE else preamble
    prefix = list(tokenizer(head, add_special_tokens=True).input_ids)  # the tokenizer's BOS, if it adds one
    tail = f"\n\nInstruction: {instruction}\n\nAnswer:" + (f" {response_prefix}" if response_prefix else "")
    return Prompt(prefix=prefix, suffix=encode(tokenizer, tail), chat=False)


def stop_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for candidate in (getattr(tokenizer, "eos_token_id", None),
                      getattr(getattr(model, "generation_config", None), "eos_token_id", None)):
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, (list, tuple)):
            ids.update(int(c) for c in candidate if c is not None)
    end_of_turn = getattr(tokenizer, "convert_tokens_to_ids", lambda _: None)("<|im_end|>")
    if isinstance(end_of_turn, int) and end_of_turn != getattr(tokenizer, "unk_token_id", None):
        ids.add(end_of_turn)
    return ids


# --- results -----------------------------------------------------------------------------------------------------


@dataclass
class SectionSummary:
    level: int  # 0: a section of the document; 1+: a group of summaries of the level below
    index: int
    start: int  # token range [start, end) of this level's input (level 0: of the document)
    end: int
    text: str
    evictions: int
    seconds: float


@dataclass
class SummaryResult:
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

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_fed / self.read_seconds if self.read_seconds > 0 else float("nan")

    def to_dict(self) -> dict:
        return asdict(self)


# --- the engine --------------------------------------------------------------------------------------------------


@dataclass
class _Run:
    """Counters shared by every pass of one summarize() call."""
    evictions: int = 0
    tokens_generated: int = 0
    tokens_fed: int = 0
    peak_slots: int = 0
    read_seconds: float = 0.0
    generate_seconds: float = 0.0


class Reader:
    """Streams token ids through fresh fixed-budget caches and generates; one per model and cache setting."""

    def __init__(self, model, tokenizer, *, policy: str = DEFAULT_POLICY, cache_size: int | None = DEFAULT_CACHE_SIZE,
                 heavy: int | None = None, recent: int | None = None, sinks: int | None = None,
                 chunk_size: int = DEFAULT_CHUNK_SIZE, rolling: bool = True, temperature: float = 0.0,
                 seed: int | None = None, repetition_penalty: float = 1.0):
        self.model, self.tokenizer = model, tokenizer
        self.policy = make_policy(policy, cache_size, heavy=heavy, recent=recent, sinks=sinks)
        self.chunk_size = _positive_int("chunk_size", chunk_size)
        self.rolling = bool(rolling)
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise H2OStreamError(f"temperature must be a number >= 0 (0 = greedy), got {temperature!r}")
        if isinstance(repetition_penalty, bool) or not isinstance(repetition_penalty, (int, float)) \
                or not repetition_penalty >= 1.0:
            raise H2OStreamError(f"repetition_penalty must be a number >= 1 (1 = off), got {repetition_penalty!r}")
        self.temperature = float(temperature)
        self.repetition_penalty = float(repetition_penalty)
        self.generator = torch.Generator().manual_seed(0 if seed is None else int(seed))
        self.stops = stop_ids(model, tokenizer)
        config = model.config.get_text_config(decoder=True)
        self.context = getattr(config, "max_position_embeddings", None)
        budget = self.policy.budget
        if self.rolling and budget is not None and self.context is not None \
                and budget + self.chunk_size > self.context:
            raise H2OStreamError(
                f"cache size {budget} + chunk size {self.chunk_size} exceeds the model's context of {self.context} "
                f"positions: use a chunk size of at most {self.context - budget}")
        self.run = _Run()

    def new_cache(self) -> StreamingCache:
        return StreamingCache(self.model, self.policy, rolling=self.rolling)

    def check_length(self, total: int, max_new_tokens: int) -> None:
        """The full policy (no eviction) is bounded by the model's context; refuse before any work."""
        if self.policy.budget is None and self.context is not None and total + max_new_tokens > self.context:
            raise H2OStreamError(
                f"the full policy keeps every token, and {total} prompt tokens + {max_new_tokens} new tokens exceed "
                f"the model's context of {self.context}: use a bounded policy (h2o, sink, window)")

    @torch.no_grad()
    def read(self, cache: StreamingCache, ids: Sequence[int],
             on_progress: Callable[[int], None] | None = None) -> torch.Tensor:
        """Feed `ids` into `cache` in chunks; `on_progress(n)` after each chunk with the tokens fed so far."""
        start = time.perf_counter()
        tensor = torch.tensor([list(ids)], dtype=torch.long)
        logits = None
        for offset in range(0, tensor.shape[1], self.chunk_size):
            piece = tensor[:, offset:offset + self.chunk_size]
            logits = feed(self.model, cache, piece, self.chunk_size)
            self._observe(cache)
            if on_progress is not None:
                on_progress(offset + piece.shape[1])
        self.run.tokens_fed += tensor.shape[1]
        self.run.read_seconds += time.perf_counter() - start
        return logits

    @torch.no_grad()
    def generate(self, cache: StreamingCache, logits: torch.Tensor, max_new_tokens: int,
                 on_text: Callable[[str], None] | None = None) -> str:
        """Decode up to `max_new_tokens` from `logits` (the next-token prediction), one token per step."""
        start = time.perf_counter()
        generated: list[int] = []
        shown = ""
        device = self.model.device
        for step in range(max_new_tokens):
            token = self._choose(logits.float(), generated)
            if token in self.stops:
                break
            generated.append(token)
            if on_text is not None:
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if not text.endswith("\ufffd") and len(text) > len(shown) and text.startswith(shown):
                    on_text(text[len(shown):])
                    shown = text
            if step + 1 < max_new_tokens:
                logits = self.model(torch.tensor([[token]], device=device), cache=cache, logits_to_keep=1).logits[0, -1]
                self.run.tokens_fed += 1
                self._observe(cache)
        text = self.tokenizer.decode(generated, skip_special_tokens=True)
        if on_text is not None and len(text) > len(shown) and text.startswith(shown):
            on_text(text[len(shown):])
        self.run.tokens_generated += len(generated)
        self.run.generate_seconds += time.perf_counter() - start
        return text.strip()

    def _choose(self, logits: torch.Tensor, generated: list[int]) -> int:
        if self.repetition_penalty != 1.0 and generated:
            seen = torch.tensor(sorted(set(generated)), device=logits.device)
            picked = logits[seen]
            logits = logits.clone()
            logits[seen] = torch.where(picked > 0, picked / self.repetition_penalty, picked * self.repetition_penalty)
        if self.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits / self.temperature, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def _observe(self, cache: StreamingCache) -> None:
        self.run.peak_slots = max(self.run.peak_slots, cache.slots)

    def answer(self, ids: Sequence[int], prompt: Prompt, max_new_tokens: int,
               on_progress: Callable[[int], None] | None = None,
               on_text: Callable[[str], None] | None = None) -> tuple[str, int]:
        """Read prompt.prefix + ids + prompt.suffix into a fresh cache and generate; (text, evictions)."""
        full = [*prompt.prefix, *ids, *prompt.suffix]
        self.check_length(len(full), max_new_tokens)
        skip, count = len(prompt.prefix), len(ids)

        def progress(done: int) -> None:
            if on_progress is not None:
                on_progress(min(max(done - skip, 0), count))

        cache = self.new_cache()
        logits = self.read(cache, full, progress)
        text = self.generate(cache, logits, max_new_tokens, on_text)
        self.run.evictions += cache.evicted
        return text, cache.evicted


def summarize(text_or_path, model=None, *, policy: str = DEFAULT_POLICY, cache_size: int | None = DEFAULT_CACHE_SIZE,
              heavy: int | None = None, recent: int | None = None, sinks: int | None = None,
              chunk_size: int = DEFAULT_CHUNK_SIZE, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
              instruction: str = DEFAULT_INSTRUCTION, strategy: str = "single", section_tokens: int | None = None,
              section_max_new_tokens: int = DEFAULT_SECTION_MAX_NEW_TOKENS,
              section_instruction: str = DEFAULT_SECTION_INSTRUCTION, book: int | str | None = None,
              rolling: bool = True, temperature: float = 0.0, seed: int | None = None,
              repetition_penalty: float = 1.0, dtype: str = "float32", device: str = "cpu",
              threads: int | None = None,
              on_progress: Callable[[int, int], None] | None = None,
              on_text: Callable[[str], None] | None = None,
              on_section: Callable[[SectionSummary], None] | None = None) -> SummaryResult:
    """Summarize a document of any length with a fixed-size KV cache.

    `text_or_path`: the text itself, a Path / file name (.txt, .md, any UTF-8 text), a PG-19 .jsonl file (with
    `book` = row index or title), or a `Document`. `model`: None (the default model), a model spec for
    `load_model`, a `LoadedModel`, or a `(model, tokenizer)` pair. `strategy`: "single" or "hierarchical" (sections of
    `section_tokens` tokens, default the cache size, each summarized in `section_max_new_tokens` tokens, then
    combined). Greedy decoding unless `temperature` > 0 (`seed` makes sampling repeatable).

    `on_progress(done, total)` reports document tokens read; `on_text(piece)` streams the final summary as it is
    generated; `on_section(section)` sees each section summary (hierarchical).
    """
    started = time.perf_counter()
    # Every argument is checked before the document is read or the model loaded.
    instruction, max_new_tokens, section_instruction = check_settings(
        strategy=strategy, instruction=instruction, max_new_tokens=max_new_tokens, policy=policy,
        cache_size=cache_size, heavy=heavy, recent=recent, sinks=sinks, chunk_size=chunk_size,
        section_tokens=section_tokens, section_max_new_tokens=section_max_new_tokens,
        section_instruction=section_instruction)
    document = as_document(text_or_path, book=book)
    net, tokenizer, name = resolve_model(model, dtype=dtype, device=device, threads=threads)
    reader = Reader(net, tokenizer, policy=policy, cache_size=cache_size, heavy=heavy, recent=recent, sinks=sinks,
                    chunk_size=chunk_size, rolling=rolling, temperature=temperature, seed=seed,
                    repetition_penalty=repetition_penalty)

    ids = encode(tokenizer, document.text)
    if not ids:
        raise H2OStreamError("the document is empty after tokenization: there is nothing to summarize")
    total = len(ids)
    report = (lambda done: on_progress(done, total)) if on_progress is not None else None
    sections: list[SectionSummary] = []
    if strategy == "single":
        prompt = build_prompt(tokenizer, instruction)
        text, _ = reader.answer(ids, prompt, max_new_tokens, report, on_text)
    else:
        size = section_tokens or reader.policy.budget or DEFAULT_CACHE_SIZE
        text = _hierarchical(reader, ids, size, instruction, max_new_tokens, section_instruction,
                             section_max_new_tokens, report, on_text, on_section, sections)
        prompt = build_prompt(tokenizer, instruction)
    run = reader.run
    return SummaryResult(
        text=text, tokens_read=total, evictions=run.evictions, seconds=time.perf_counter() - started,
        strategy=strategy, policy=reader.policy.settings(), cache_size=reader.policy.budget, chunk_size=chunk_size,
        rolling=reader.rolling, tokens_generated=run.tokens_generated, tokens_fed=run.tokens_fed,
        peak_slots=run.peak_slots, read_seconds=run.read_seconds, generate_seconds=run.generate_seconds,
        title=document.title, source=document.source, model=name, chat_template=prompt.chat, sections=sections)


def check_settings(*, strategy: str, instruction, max_new_tokens, policy: str, cache_size, heavy=None, recent=None,
                   sinks=None, chunk_size=DEFAULT_CHUNK_SIZE, section_tokens=None,
                   section_max_new_tokens=DEFAULT_SECTION_MAX_NEW_TOKENS,
                   section_instruction=DEFAULT_SECTION_INSTRUCTION) -> tuple[str, int, str]:
    """Refuse bad settings with one clear message; (instruction, max_new_tokens, section_instruction) cleaned."""
    if strategy not in STRATEGIES:
        raise H2OStreamError(f"unknown strategy {strategy!r}: choose one of {', '.join(STRATEGIES)}")
    instruction = _nonempty("instruction", instruction)
    max_new_tokens = _positive_int("max_new_tokens", max_new_tokens)
    if strategy == "hierarchical":
        section_instruction = _nonempty("section_instruction", section_instruction)
        _positive_int("section_max_new_tokens", section_max_new_tokens)
        if section_tokens is not None:
            _positive_int("section_tokens", section_tokens)
    make_policy(policy, cache_size, heavy=heavy, recent=recent, sinks=sinks)  # raises on a bad policy setting
    _positive_int("chunk_size", chunk_size)
    return instruction, max_new_tokens, section_instruction


def _hierarchical(reader: Reader, ids: list[int], size: int, instruction: str, max_new_tokens: int,
                  section_instruction: str, section_max_new_tokens: int, report, on_text, on_section,
                  sections: list[SectionSummary]) -> str:
    tokenizer = reader.tokenizer
    section_prompt = build_prompt(tokenizer, section_instruction)
    combine_prompt = build_prompt(tokenizer, section_instruction, preamble=SUMMARIES_PREAMBLE)
    final_prompt = build_prompt(tokenizer, instruction, preamble=SUMMARIES_PREAMBLE)

    if len(ids) <= size:
        # One section: its summary would only be summarized again; answer the real instruction directly instead.
        text, _ = reader.answer(ids, build_prompt(tokenizer, instruction), max_new_tokens, report, on_text)
        return text

    # Level 0: the document, section by section.
    summaries: list[str] = []
    for index, start in enumerate(range(0, len(ids), size)):
        piece = ids[start:start + size]
        progress = (lambda done, base=start: report(base + done)) if report is not None else None
        summaries.append(_section(reader, piece, section_prompt, section_max_new_tokens, 0, index, start, progress,
                                  on_section, sections))
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
            combined.append(_section(reader, group_ids, combine_prompt, section_max_new_tokens, level, index, offset,
                                     None, on_section, sections))
            offset += len(group_ids)
        summaries = combined
    joined = [t for i, s in enumerate(summaries) for t in encode(tokenizer, _numbered(i, s))]
    text, _ = reader.answer(joined, final_prompt, max_new_tokens, None, on_text)
    return text


def _section(reader, piece, prompt, max_new_tokens, level, index, start, progress, on_section, sections) -> str:
    began = time.perf_counter()
    text, evicted = reader.answer(piece, prompt, max_new_tokens, progress)
    section = SectionSummary(level=level, index=index, start=start, end=start + len(piece), text=text,
                             evictions=evicted, seconds=time.perf_counter() - began)
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


def resolve_model(model, *, dtype: str = "float32", device: str = "cpu", threads: int | None = None):
    """(model, tokenizer, name) from None / a spec string / a LoadedModel / a (model, tokenizer) pair."""
    if model is None or isinstance(model, (str, os.PathLike)):
        try:
            from h2o_stream.loading.models import load_model
        except ImportError as error:
            raise H2OStreamError(f"cannot load models here ({error}): pass a (model, tokenizer) pair") from None
        loaded = load_model(model, dtype=dtype, device=device, threads=threads)
        return loaded.model, loaded.tokenizer, loaded.name
    if hasattr(model, "model") and hasattr(model, "tokenizer"):
        return model.model, model.tokenizer, getattr(model, "name", None)
    if threads is not None:  # load_model applies it for the other forms
        torch.set_num_threads(_positive_int("threads", threads))
    if isinstance(model, (tuple, list)) and len(model) == 2:
        net, tokenizer = model
        return net, tokenizer, getattr(getattr(net, "config", None), "_name_or_path", None) or None
    raise H2OStreamError(f"model must be a model spec, a LoadedModel or a (model, tokenizer) pair, "
                         f"got {type(model).__name__}")


def _nonempty(name: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise H2OStreamError(f"{name} is empty: say what the summary should be (e.g. {DEFAULT_INSTRUCTION!r})")
    return value.strip()


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise H2OStreamError(f"{name} must be a whole number >= 1, got {value!r}")
    if value <= 0:
        raise H2OStreamError(f"{name} must be >= 1, got {value}")
    return value
