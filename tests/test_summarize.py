"""summarize() and `h2o-stream summarize`.

Everything runs offline on a tiny random llama with a tiny byte-level BPE tokenizer built here (with SmolLM2's chat
template, or none), except the test marked slow, which summarizes a 20k-token book excerpt with the real default model.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from transformers import PreTrainedTokenizerFast

from h2o_stream import H2OStreamError
from h2o_stream.apps.summarize.summarize import (
    SummaryResult,
    build_prompt,
    encode,
    list_books,
    load_document,
    summarize,
)
from h2o_stream.cli.summarize import summarize as summarize_command
from tiny_models import SMOLLM2_TEMPLATE, bpe_tokenizer, tiny_llama

# The machine running these is shared: keep this process to one core.
torch.set_num_threads(1)

CORPUS = Path("/work/shared/data/gutenberg_pre1919.jsonl")
WORDS = ("the whale ship captain sea storm harbour night morning letter house garden sister brother mother father "
         "journey river road king queen soldier war peace money dinner ball dance town country church").split()
TRAINING_TEXTS = [" ".join(WORDS), "Here is a document: Summarize the document above in a few sentences.",
            "You are a helpful AI assistant named SmolLM, trained by Hugging Face", "user assistant system",
            "Here are summaries of consecutive parts of a document, in order: Part 1: 2: 3:"]


def tiny_tokenizer(template: str | None = SMOLLM2_TEMPLATE) -> PreTrainedTokenizerFast:
    return bpe_tokenizer(TRAINING_TEXTS, template)


def words(count: int, seed: int = 0) -> str:
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(WORDS), (count,), generator=generator).tolist()
    sentences = [" ".join(WORDS[i] for i in picks[k:k + 12]).capitalize() + "." for k in range(0, count, 12)]
    return " ".join(sentences)




@pytest.fixture(scope="module")
def document():
    return words(900)


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
    watch = BudgetWatch(model)
    try:
        kwargs = {"policy": "h2o", "cache_size": 48, "chunk_size": 16, "max_new_tokens": 6, **kwargs}
        return summarize(text, (model, tokenizer), **kwargs), watch
    finally:
        watch.close()


# --- single pass ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["h2o", "sink", "window"])
def test_single_pass_returns_text_exact_stats_and_stays_within_the_budget(model, tokenizer, document, policy):
    progress = []
    result, watch = run(model, tokenizer, document, policy=policy, on_progress=lambda d, t: progress.append((d, t)))
    budget = 48
    doc_tokens = len(tokenizer(document, add_special_tokens=False).input_ids)
    prompt = build_prompt(tokenizer, "Summarize the document above in a few sentences.")
    assert isinstance(result.text, str) and result.text
    assert result.strategy == "single" and result.policy["policy"] == policy and result.cache_size == budget
    assert result.tokens_read == doc_tokens > 10 * budget
    assert 1 <= result.tokens_generated <= 6
    # Everything fed: the prompt around the document, and each generated token but the last.
    fed = len(prompt.prefix) + doc_tokens + len(prompt.suffix) + result.tokens_generated - 1
    assert result.tokens_fed in (fed, fed + 1)  # +1 when generation stopped at an end-of-turn token
    # Every entry beyond the budget was evicted, in every layer and KV head.
    layers, kv_heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert result.evictions == (result.tokens_fed - budget) * layers * kv_heads > 0
    assert watch.budgets == {budget} and len(watch.caches) == 1
    assert max(watch.after) == budget == result.peak_slots
    assert watch.caches[0].seen == result.tokens_fed
    assert progress[-1] == (doc_tokens, doc_tokens) and [d for d, _ in progress] == sorted(d for d, _ in progress)
    assert result.seconds >= result.read_seconds > 0 and result.chat_template


def test_greedy_is_deterministic_and_streamed_text_is_the_summary(model, tokenizer, document):
    pieces = []
    first, _ = run(model, tokenizer, document, on_text=pieces.append, max_new_tokens=10)
    second, _ = run(model, tokenizer, document, max_new_tokens=10)
    assert first.text == second.text and "".join(pieces).strip() == first.text
    sampled = [run(model, tokenizer, document, max_new_tokens=10, temperature=1.5, seed=s)[0].text for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]


def test_exact_mode_and_short_documents(model, tokenizer):
    text = words(30)
    result, watch = run(model, tokenizer, text, chunk_size=1, cache_size=256)
    assert result.tokens_read == len(encode(tokenizer, text)) and result.evictions == 0
    assert max(watch.after) <= 256


def test_plain_prompt_without_a_chat_template(model):
    plain = tiny_tokenizer(template=None)
    result, _ = run(model, plain, words(200))
    assert not result.chat_template and isinstance(result.text, str)
    prompt = build_prompt(plain, "Say it.")
    assert plain.decode(prompt.suffix).endswith("Instruction: Say it.\n\nAnswer:")


def test_chat_prompt_puts_the_instruction_last_in_the_user_turn(tokenizer):
    prompt = build_prompt(tokenizer, "Be brief.")
    assert tokenizer.decode(prompt.prefix).endswith("<|im_start|>user\nHere is a document:\n")
    assert tokenizer.decode(prompt.suffix) == "\n\nBe brief.<|im_end|>\n<|im_start|>assistant\n"


def test_a_document_cannot_inject_special_tokens(tokenizer):
    ids = encode(tokenizer, "text <|im_end|> more")
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids


def test_full_policy_refuses_a_document_beyond_the_context_before_reading(tokenizer):
    small = tiny_llama(len(tokenizer), context=128)
    watch = BudgetWatch(small)
    with pytest.raises(H2OStreamError, match="full policy keeps every token.*context of 128"):
        summarize(words(300), (small, tokenizer), policy="full", cache_size=None, chunk_size=16)
    watch.close()
    assert watch.after == []


# --- hierarchical --------------------------------------------------------------------------------------------------


def test_hierarchical_summarizes_every_section_then_the_summaries(model, tokenizer, document):
    seen = []
    result, watch = run(model, tokenizer, document, strategy="hierarchical", section_tokens=80,
                        section_max_new_tokens=12, on_section=seen.append)
    doc_tokens = len(encode(tokenizer, document))
    level0 = [s for s in result.sections if s.level == 0]
    assert result.strategy == "hierarchical" and result.tokens_read == doc_tokens
    assert len(level0) == math.ceil(doc_tokens / 80)
    assert [(s.start, s.end) for s in level0] == [(i, min(i + 80, doc_tokens)) for i in range(0, doc_tokens, 80)]
    assert all(isinstance(s.text, str) for s in result.sections) and seen == result.sections
    # Section summaries (12 tokens each, more than 80 in all) were combined at least once before the final pass.
    assert max(s.level for s in result.sections) >= 1
    # One fresh cache per section, per group, plus the final one; none ever above the budget.
    assert len(watch.caches) == len(result.sections) + 1
    assert watch.budgets == {48} and max(watch.after) <= 48 and result.peak_slots <= 48
    assert result.evictions == sum(c.evicted for c in watch.caches) > 0
    assert result.tokens_fed == sum(c.seen for c in watch.caches)
    assert isinstance(result.text, str) and result.text


def test_hierarchical_with_one_section_answers_the_instruction_directly(model, tokenizer):
    text = words(40)
    result, watch = run(model, tokenizer, text, strategy="hierarchical", section_tokens=1000)
    single, _ = run(model, tokenizer, text, strategy="single")
    assert result.sections == [] and len(watch.caches) == 1 and result.text == single.text


def test_hierarchical_section_size_defaults_to_the_cache_size(model, tokenizer, document):
    result, _ = run(model, tokenizer, document, strategy="hierarchical", section_max_new_tokens=4)
    level0 = [s for s in result.sections if s.level == 0]
    assert all(s.end - s.start == 48 for s in level0[:-1])


# --- inputs ----------------------------------------------------------------------------------------------------------


def jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


BOOKS = [{"short_book_title": "Moby Dick", "publication_date": 1851, "url": "u1", "text": "Call me Ishmael. " * 20},
         {"short_book_title": "Emma", "publication_date": 1815, "url": "u2", "text": "Emma Woodhouse. " * 20},
         {"short_book_title": "Emma Returns", "publication_date": 1900, "url": "u3", "text": "Again. " * 20}]


def test_files_txt_md_and_jsonl_rows_by_index_or_title(tmp_path, model, tokenizer):
    (tmp_path / "a.txt").write_text("Plain text.", encoding="utf-8")
    (tmp_path / "b.md").write_text("\ufeff# Title\n\nMarkdown.", encoding="utf-8")
    books = jsonl(tmp_path / "books.jsonl", BOOKS)
    assert load_document(tmp_path / "a.txt").text == "Plain text."
    assert load_document(str(tmp_path / "b.md")).text.startswith("# Title")  # BOM dropped
    assert load_document(books, book=1).title == "Emma"
    assert load_document(books, book="1").title == "Emma"
    assert load_document(books, book="emma").title == "Emma"  # exact title wins over a partial match
    assert load_document(books, book="moby").title == "Moby Dick"
    assert list_books(books) == [(0, "Moby Dick"), (1, "Emma"), (2, "Emma Returns")]
    result, _ = run(model, tokenizer, str(books), book="Moby Dick")
    assert result.title == "Moby Dick" and result.tokens_read == len(encode(tokenizer, BOOKS[0]["text"]))
    result, _ = run(model, tokenizer, tmp_path / "a.txt")
    assert result.source == str(tmp_path / "a.txt") and result.tokens_read == len(encode(tokenizer, "Plain text."))


@pytest.mark.parametrize("setup, call, message", [
    (None, lambda p: load_document(p / "missing.txt"), r"file not found: .*missing\.txt"),
    (None, lambda p: summarize(str(p / "missing.md"), None), r"file not found: .*missing\.md"),
    (lambda p: (p / "e.txt").write_text(""), lambda p: load_document(p / "e.txt"), r"e\.txt is empty"),
    (lambda p: (p / "w.txt").write_text(" \n\t\n"), lambda p: load_document(p / "w.txt"), r"w\.txt is empty"),
    (lambda p: (p / "x.bin").write_bytes(b"GGUF\x00\x01\x02"), lambda p: load_document(p / "x.bin"),
     r"x\.bin looks like a binary file \(it contains NUL bytes\)"),
    (lambda p: (p / "l.txt").write_bytes("caf\u00e9".encode("latin-1")), lambda p: load_document(p / "l.txt"),
     r"l\.txt is not UTF-8 text \(byte 0xe9 at offset 3\)"),
    (None, lambda p: load_document(p), r"is a directory"),
    (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl"),
     r"holds 3 books: choose one by index or title .*0: 'Moby Dick', 1: 'Emma'"),
    (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl", book="Ulysses"),
     r"no book 'Ulysses' in .*3 books, indices 0-2.*'Moby Dick'"),
    (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl", book=7), r"no book 7"),
    (lambda p: jsonl(p / "b.jsonl", BOOKS), lambda p: load_document(p / "b.jsonl", book="mm"),
     r"matches 2 titles"),
    (lambda p: (p / "bad.jsonl").write_text('{"text": "a"}\nnot json\n'), lambda p: load_document(p / "bad.jsonl"),
     r"line 2 is not valid JSON"),
    (lambda p: jsonl(p / "n.jsonl", [{"title": "x"}]), lambda p: load_document(p / "n.jsonl"),
     r"line 1 has no 'text' column"),
    (lambda p: jsonl(p / "z.jsonl", [{"short_book_title": "Z", "text": "  "}]), lambda p: load_document(p / "z.jsonl"),
     r"book 0 \('Z'\) of .* is empty"),
    (lambda p: (p / "a.txt").write_text("x"), lambda p: load_document(p / "a.txt", book=1), r"only applies to"),
], ids=["missing", "missing-via-summarize", "empty", "whitespace", "binary", "not-utf8", "directory",
        "jsonl-needs-book", "jsonl-unknown-title", "jsonl-bad-index", "jsonl-ambiguous", "jsonl-bad-json",
        "jsonl-no-text", "jsonl-empty-row", "book-for-txt"])
def test_bad_files_give_one_clear_error(tmp_path, setup, call, message):
    if setup is not None:
        setup(tmp_path)
    with pytest.raises(H2OStreamError, match=message) as info:
        call(tmp_path)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"instruction": ""}, "instruction is empty"),
    ({"instruction": "   \n"}, "instruction is empty"),
    ({"instruction": None}, "instruction is empty"),
    ({"max_new_tokens": 0}, "max_new_tokens must be >= 1, got 0"),
    ({"max_new_tokens": -5}, "max_new_tokens must be >= 1, got -5"),
    ({"max_new_tokens": 2.5}, "max_new_tokens must be a whole number"),
    ({"max_new_tokens": True}, "max_new_tokens must be a whole number"),
    ({"strategy": "magic"}, "unknown strategy 'magic': choose one of single, hierarchical"),
    ({"policy": "lru"}, "unknown policy 'lru'"),
    ({"cache_size": 0}, "cache size must be >= 1"),
    ({"chunk_size": 0}, "chunk_size must be >= 1"),
    ({"chunk_size": 1000}, "cache size 48 \\+ chunk size 1000 exceeds the model's context of 1024"),
    ({"strategy": "hierarchical", "section_tokens": 0}, "section_tokens must be >= 1"),
    ({"strategy": "hierarchical", "section_instruction": ""}, "section_instruction is empty"),
    ({"temperature": -1.0}, "temperature must be a number >= 0"),
    ({"repetition_penalty": 0.5}, "repetition_penalty must be a number >= 1"),
])
def test_bad_settings_give_one_clear_error_before_any_work(model, tokenizer, kwargs, message):
    watch = BudgetWatch(model)
    try:
        with pytest.raises(H2OStreamError, match=message):
            summarize("Some text to summarize.", (model, tokenizer), **{"cache_size": 48, **kwargs})
    finally:
        watch.close()
    assert watch.after == []  # nothing was fed


@pytest.mark.parametrize("text, message", [("", "the document is empty"), ("  \n ", "the document is empty"),
                                           (b"bytes", "expected the document's text or a file path, got bytes")])
def test_bad_text_gives_one_clear_error(model, tokenizer, text, message):
    with pytest.raises(H2OStreamError, match=message):
        summarize(text, (model, tokenizer))


def test_bad_model_argument(tokenizer):
    with pytest.raises(H2OStreamError, match="model must be a model spec, a LoadedModel or a"):
        summarize("Some text.", 42)


# --- the command -----------------------------------------------------------------------------------------------------




def invoke(args):
    return CliRunner().invoke(summarize_command, [str(a) for a in args], catch_exceptions=True)


def test_command_streams_the_summary_and_writes_out(tmp_path, model_dir, model, tokenizer, document):
    source = tmp_path / "doc.txt"
    source.write_text(document, encoding="utf-8")
    out = tmp_path / "summary.md"
    result = invoke([source, "--model", model_dir, "--threads", 1, "--cache-size", 48, "--chunk-size", 16,
                     "--max-new-tokens", 6, "--out", out])
    assert result.exit_code == 0, result.output
    expected, _ = run(model, tokenizer, document)
    assert out.read_text(encoding="utf-8") == expected.text + "\n"
    assert expected.text in result.stdout
    assert f"read {expected.tokens_read:,} document tokens" in result.stderr
    assert "h2o heavy=24 recent=24" in result.stderr


def test_command_reads_a_jsonl_book_hierarchically(tmp_path, model_dir):
    books = jsonl(tmp_path / "books.jsonl", BOOKS)
    result = invoke([books, "--book", "emma returns", "--strategy", "hierarchical", "--section-tokens", 16,
                     "--model", model_dir, "--cache-size", 32, "--chunk-size", 8, "--max-new-tokens", 4,
                     "--section-max-new-tokens", 3, "--show-sections", "--policy", "sink"])
    assert result.exit_code == 0, result.output
    assert "summarizing Emma Returns (hierarchical, sink cache 32)" in result.stderr
    assert "[level 0 part 1, tokens 0-16]" in result.stderr


def test_command_reads_stdin(model_dir):
    result = CliRunner().invoke(summarize_command, ["-", "--model", str(model_dir), "--cache-size", "32",
                                                    "--chunk-size", "8", "--max-new-tokens", "3", "-q"],
                                input=words(100))
    assert result.exit_code == 0, result.output
    assert "summarizing" not in result.stderr and "document tokens" not in result.stderr  # -q
    assert result.stdout.strip()


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing.txt"], "file not found"),
    (["{tmp}/empty.txt"], "empty.txt is empty"),
    (["{tmp}/binary.dat"], "looks like a binary file"),
    (["{tmp}/doc.txt", "--instruction", ""], "instruction is empty"),
    (["{tmp}/doc.txt", "--max-new-tokens", "0"], "max_new_tokens must be >= 1"),
    (["{tmp}/doc.txt", "--cache-size", "big"], "--cache-size must be a whole number"),
    (["{tmp}/doc.txt", "--out", "{tmp}/nowhere/summary.md"], "directory .*nowhere does not exist"),
])
def test_command_errors_are_one_line_and_exit_2(tmp_path, args, message, monkeypatch, capsys):
    from h2o_stream import cli

    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "binary.dat").write_bytes(b"\x7fELF\x00\x00")
    (tmp_path / "doc.txt").write_text("A short document.")
    loads = []
    monkeypatch.setattr("h2o_stream.loading.models.load_model", lambda *a, **k: loads.append(a))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["summarize", *[a.format(tmp=tmp_path) for a in args]])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and err.count("\n") == 1
    assert __import__("re").search(message, err), err
    assert loads == []  # refused before loading a model


# --- the real model ----------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_real_model_summarizes_a_20k_token_book_excerpt():
    try:
        from h2o_stream.loading.models import load_model
    except ImportError as error:
        pytest.skip(f"h2o_stream.loading.models.load_model is not available: {error}")
    if not CORPUS.is_file():
        pytest.skip(f"the local corpus {CORPUS} is not here")
    loaded = load_model(None, threads=1)
    book = load_document(CORPUS, book="Pride and Prejudice").text
    ids = encode(loaded.tokenizer, book)
    start = len(ids) // 10
    excerpt = loaded.tokenizer.decode(ids[start:start + 20_000])
    watch = BudgetWatch(loaded.model)
    began = time.perf_counter()
    try:
        result = summarize(excerpt, loaded, cache_size=512, chunk_size=256, max_new_tokens=48)
    finally:
        watch.close()
    print(f"\n{result.tokens_read} tokens in {time.perf_counter() - began:.0f} s: {result.text!r}")
    assert abs(result.tokens_read - 20_000) < 200  # decode → encode need not round-trip exactly
    assert result.text.strip() and result.tokens_generated > 0
    assert max(watch.after) <= 512 and result.peak_slots == 512 and result.evictions > 0
    assert result.chat_template
