"""`ppl --resume` is bound to its data, model, dtype and settings, never shortens a run, equals one uninterrupted run
for any --tokens / --checkpoint-every, and a stream with nothing to predict is an error (no NaN results)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import shlex

import pytest
import torch

from h2o_stream import H2OStreamError, make_policy
from h2o_stream.apps.perplexity.binding import Plan, check_stream
from h2o_stream.apps.perplexity.digest import StreamDigest
from h2o_stream.apps.perplexity.execution import execute
from h2o_stream.apps.perplexity.run import CHECKPOINT_KIND, CHECKPOINT_VERSION, PerplexityRun
from h2o_stream.apps.perplexity.stream import token_pieces
from h2o_stream.files import write_json, write_verified
from support.ppl_helpers import TEXT, ppl, ppl_error, result, snapshot, write_corpus
from support.tiny_models import char_tokenizer, tiny_model


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


@pytest.fixture
def finished(ppl_model_dir, corpus, tmp_path, capsys):
    """A finished 300-token h2o run in tmp_path/out; (its arguments without --tokens/--resume, out)."""
    out = tmp_path / "out"
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--checkpoint-every",
        64,
        "--out",
        out,
    ]
    assert ppl(capsys, *args, "--tokens", 300)[0] == 0
    return args, out


# -- a run is bound to its corpus, model, dtype and settings ------------------------------------------------


def test_resume_refuses_another_corpus_under_the_same_name(finished, corpus, capsys):
    args, out = finished
    before = snapshot(out)
    write_corpus(corpus, books=2, text=TEXT.upper())  # another corpus, same file name
    message = ppl_error(capsys, *args, "--tokens", 600, "--resume")
    assert "the corpus is another text" in message and "data_sha256" in message
    assert snapshot(out) == before


def test_resume_refuses_a_corpus_edited_in_place(finished, corpus, capsys):
    args, out = finished
    before = snapshot(out)
    text = corpus.read_text()
    corpus.write_text(text.replace("worst", "wurst", 1))  # same size, one letter inside the fed tokens
    assert "the corpus is another text" in ppl_error(capsys, *args, "--tokens", 600, "--resume")
    assert snapshot(out) == before
    corpus.write_text(text)  # the original again: resumes
    assert ppl(capsys, *args, "--tokens", 600, "--resume")[0] == 0


def test_a_checkpoint_is_checked_against_the_tokens_it_fed():
    # the guard for a corpus read from the Hub, which has no local bytes to digest: the fed tokens themselves
    book = torch.arange(40)
    fed = StreamDigest()
    fed.update(0, book[:24])
    checkpoint = Plan("h2o-16", position=24, stream_digest=fed.hexdigest())
    assert check_stream([(0, book)], [checkpoint], tokens=40, reset_per_book=False, source="pg19", skip_tokens=0) == 40
    edited = book.clone()
    edited[10] += 1
    with pytest.raises(H2OStreamError, match="tokens it fed differ"):
        check_stream([(0, edited)], [checkpoint], tokens=40, reset_per_book=False, source="pg19", skip_tokens=0)


def test_a_resumed_run_says_where_it_resumed_and_why(finished, capsys):
    args, out = finished
    code, _, err = ppl(capsys, *args, "--tokens", 600, "--resume")
    assert code == 0, err
    # 300 tokens were asked for first, in forwards of 256: the checkpoint before the last, cut-short forward (256)
    assert (
        f"resumed at token 256: the tokens before it were scored by an earlier run, whose checkpoint is "
        f"{out / 'h2o-16.ckpt'} (that run went on to token 300: it checkpoints before a last forward cut short "
        "by --tokens, so that a longer run makes that forward whole)"
    ) in err


def test_the_same_corpus_at_another_path_resumes(finished, corpus, tmp_path, capsys):
    # a run is bound to its text (size and sha256), not to where it lies: a copy elsewhere continues it
    args, out = finished
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = elsewhere / corpus.name
    moved.write_bytes(corpus.read_bytes())
    args = [str(moved) if a == corpus else a for a in args]
    assert ppl(capsys, *args, "--tokens", 600, "--resume")[0] == 0
    assert result(out, "h2o-16")["tokens_fed"] == 600


def test_resume_refuses_another_text_under_the_same_path_even_past_the_fed_tokens(finished, corpus, capsys):
    args, out = finished
    before = snapshot(out)
    corpus.write_text(corpus.read_text() + " One sentence more at the very end.")
    assert "data_sha256" in ppl_error(capsys, *args, "--tokens", 600, "--resume")
    assert snapshot(out) == before


def test_resume_with_another_dtype_is_one_error_line_and_changes_nothing(finished, capsys):
    args, out = finished
    before = snapshot(out)
    message = ppl_error(capsys, *args, "--tokens", 600, "--resume", "--dtype", "bfloat16")
    assert "dtype: 'float32' → 'bfloat16'" in message
    assert snapshot(out) == before


def test_results_record_what_they_are_bound_to(finished, corpus):
    _, out = finished
    done = result(out, "h2o-16")
    settings = done["settings"]
    assert settings["dtype"] == "float32" and settings["device"] == "cpu" and len(settings["model_weights"]) == 16
    assert settings["data_sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert settings["curve_every"] == 1000
    assert settings["data_bytes"] == corpus.stat().st_size and "data_path" not in settings
    assert done["data_path"] == os.path.relpath(corpus.resolve())  # where it was read, relative, outside the binding
    assert not any(os.path.isabs(word) for word in shlex.split(done["command"]))
    assert len(done["stream_sha256"]) == 64


# -- a finished run is never replaced by a shorter one ------------------------------------------------------


def test_resume_with_fewer_tokens_refuses_and_keeps_the_finished_result(finished, capsys):
    args, out = finished
    before = snapshot(out)
    message = ppl_error(capsys, *args, "--tokens", 150, "--resume")
    assert "300 tokens for h2o-16" in message and "shorter" in message
    assert snapshot(out) == before
    assert ppl(capsys, *args, "--tokens", 300, "--resume")[0] == 0  # the same length again is fine
    assert result(out, "h2o-16")["tokens_fed"] == 300


# -- extending a run equals one uninterrupted run, for any --tokens and --checkpoint-every -------------------


@pytest.fixture(scope="module")
def tiny_lm():
    return tiny_model("llama", init_std=0.2), char_tokenizer()


def extend(tiny_lm, policy, books, checkpoint, tokens, every, span=None) -> PerplexityRun:
    """`ppl --tokens TOKENS --checkpoint-every EVERY` (with --resume when `checkpoint` exists), as the sweep runs it."""
    model, tokenizer = tiny_lm
    run = PerplexityRun(model, make_policy(policy, 16), chunk_size=16, span=span, curve_every=50)
    if checkpoint.exists():
        run.load(checkpoint)
    execute([run], token_pieces(books, tokenizer), tokens, [checkpoint], every)
    return run


@pytest.mark.parametrize("policy", ["h2o", "sink"])
def test_extending_equals_one_run_for_any_tokens_and_checkpoint_pace(tiny_lm, policy, tmp_path):
    books, total = [TEXT[:150], TEXT[:200]], 320
    whole = extend(tiny_lm, policy, books, tmp_path / "whole.ckpt", total, 10**6)
    rng = random.Random(5)
    # (--tokens of the first call, of a second one (or None), --checkpoint-every); the first case is the pattern
    # that once lost tokens (a checkpoint due right after a last chunk cut short), the others are drawn
    cases = [(100, None, 4)] + [(rng.randrange(20, 310), None, rng.choice([1, 7, 16, 50, 1000])) for _ in range(5)]
    cases += [(45, 230, 3), (151, 152, 1)]  # extended twice; the second time across a book boundary
    for i, (first, second, every) in enumerate(cases if policy == "h2o" else cases[:3]):  # sink: fewer, it is slower
        checkpoint = tmp_path / f"case{i}.ckpt"
        for tokens in (first, second, total):
            if tokens is not None:
                extended = extend(tiny_lm, policy, books, checkpoint, tokens, every)
        assert extended.nll_sum.item() == whole.nll_sum.item(), (first, second, every)
        assert extended.curve == whole.curve and extended.predicted == whole.predicted


def test_memory_is_sampled_within_each_process_of_a_resumed_run(tiny_lm, tmp_path):
    """RSS is sampled at doublings of the stream position and of the tokens the current process fed, and at the
    end, and each resume records where its process began: growth can then be read within one process."""
    books, checkpoint = [TEXT[:150], TEXT[:200]], tmp_path / "run.ckpt"
    first = extend(tiny_lm, "h2o", books, checkpoint, 100, 16, span=16)
    assert first.process_starts == [0]
    assert [n for n, _ in first.result().rss_samples] == [16, 32, 64, 100]  # 100: the end
    second = extend(tiny_lm, "h2o", books, checkpoint, 320, 16, span=16)
    # the first run's checkpoint is at 96, where an uninterrupted run's forward would end (not 100, cut short)
    assert second.process_starts == [0, 96]
    positions = [n for n, _ in second.result().rss_samples]
    # 16, 32, 64: the first process (its end sample is not checkpointed); 112: the resumed process's first forward;
    # 128 and 160 double the 16 tokens it had fed then, 224 the 64 of 160; 320: the end
    assert positions == [16, 32, 64, 112, 128, 160, 224, 320]
    record = second.result().to_json()
    assert record["process_starts"] == [0, 96] and record["peak_rss_bytes"] >= max(b for _, b in record["rss_samples"])
    # a checkpoint from before process_starts was recorded: only the resumes since count
    state = first.read(checkpoint)
    del state["process_starts"]
    write_verified(checkpoint, CHECKPOINT_KIND, CHECKPOINT_VERSION, state)
    assert extend(tiny_lm, "h2o", books, checkpoint, 330, 16, span=16).process_starts == [320]


# -- nothing to predict is an error, and no JSON file ever holds NaN ----------------------------------------


def test_skip_tokens_past_the_end_is_an_error_and_writes_nothing(ppl_model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    message = ppl_error(
        capsys,
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--skip-tokens",
        10**6,
        "--policy",
        "sink",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--out",
        out,
    )
    assert "nothing to predict" in message and "--skip-tokens 1,000,000" in message
    assert not list(out.glob("*.json")) and not list(out.glob("*.ckpt"))


def test_a_one_token_file_is_an_error(model_dir, tmp_path, capsys):
    """The conftest tokenizer adds no BOS: a one-character file is one token, and nothing follows it."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("a")
    message = ppl_error(
        capsys,
        "--model",
        model_dir,
        "--data",
        corpus,
        "--policy",
        "sink",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--out",
        tmp_path / "out",
    )
    assert "nothing to predict" in message and "has 1 token(s)" in message
    assert "--tokens must be at least 2" in ppl_error(
        capsys, "--model", model_dir, "--data", corpus, "--tokens", 1, "--out", tmp_path / "out"
    )


def test_json_is_written_strictly(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(ValueError):
        write_json(path, {"ppl": float("nan")})
    assert list(tmp_path.iterdir()) == []
    write_json(path, {"ppl": 1.5})
    assert json.loads(path.read_text()) == {"ppl": 1.5}
