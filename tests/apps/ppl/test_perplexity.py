"""Streaming perplexity: chunked vs exact, stream accounting, checkpoint/resume (also after SIGKILL), bad inputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from h2o_stream import make_policy, stream_perplexity
from h2o_stream.apps.perplexity.run import PerplexityRun
from h2o_stream.apps.perplexity.stream import NLL_ROWS, token_nll, token_pieces
from support.policy_matrix import BANDED, SCORED, build
from support.ppl_helpers import TEXT, ppl, write_corpus
from support.tiny_models import char_tokenizer, random_ids, tiny_model


def token_nlls(model, policy, ids, chunk_size):
    run = PerplexityRun(model, policy, chunk_size=chunk_size, record_tokens=True)
    run.run(token_pieces(ids))
    return torch.cat(run.token_nll)


@pytest.mark.parametrize("family", ["llama", "gpt_neox", "llama_yarn", "mistral"])
@pytest.mark.parametrize("policy", BANDED)
@pytest.mark.parametrize("chunk", [5, 32])
def test_chunked_band_policies_equal_exact_mode_per_token(family, policy, chunk):
    model = tiny_model(family, init_std=0.2)
    ids = random_ids(260)[0]
    spec = make_policy(policy, 24)
    exact = token_nlls(model, spec, ids, 1)
    chunked = token_nlls(model, spec, ids, chunk)
    assert exact.shape == chunked.shape == (259,)
    assert torch.allclose(chunked, exact, atol=1e-4, rtol=0), (chunked - exact).abs().max()


@pytest.mark.parametrize("policy", SCORED)
def test_chunked_scored_policies_differ_from_exact_but_stay_close(policy):
    """Chunked H2O attends over budget + chunk keys and decides once per chunk: not equal, measured in eval/."""
    model = tiny_model("llama", init_std=0.2)
    ids = random_ids(300)[0]
    spec = build(policy, 24)
    exact, chunked = token_nlls(model, spec, ids, 1), token_nlls(model, spec, ids, 16)
    assert not torch.allclose(exact, chunked, atol=1e-4)
    assert abs(exact.mean() - chunked.mean()) < 0.1 * exact.mean()


def test_full_policy_matches_one_plain_forward():
    model = tiny_model("qwen2")
    ids = random_ids(200)
    expected = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="sum")
    result = stream_perplexity(model, None, ids[0], policy="full", chunk_size=48)
    assert result.predicted == 199 and result.tokens_fed == 200
    assert result.nll_sum == pytest.approx(expected.item(), rel=1e-5)


@pytest.mark.parametrize("rows", [1, NLL_ROWS - 1, NLL_ROWS, NLL_ROWS + 1, 8 * NLL_ROWS + 5])
def test_token_nll_in_blocks_equals_one_cross_entropy_bit_for_bit(rows):
    generator = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 5000, generator=generator) * 4
    targets = torch.randint(0, 5000, (rows,), generator=generator)
    expected = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
    assert torch.equal(token_nll(logits, targets), expected)


def test_chunks_with_pending_logits_sum_the_nll_of_one_plain_forward():
    """The first token of every chunk after the first is predicted by the previous chunk's last logits."""
    model = tiny_model("llama")
    ids = random_ids(3 * NLL_ROWS + 7)
    expected = torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
    run = PerplexityRun(model, make_policy("full"), chunk_size=NLL_ROWS + 3, record_tokens=True)
    run.run(token_pieces(ids[0]))
    assert run.predicted == ids.shape[1] - 1
    assert torch.allclose(torch.cat(run.token_nll), expected, atol=1e-5, rtol=0)


def test_books_are_concatenated_or_reset():
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    books = ["first book " * 20, "second book " * 20]
    lengths = [len(tokenizer(b)["input_ids"]) for b in books]
    joined = stream_perplexity(model, tokenizer, books, policy="sink", cache_size=16, chunk_size=8)
    assert joined.predicted == sum(lengths) - 1  # every token but the stream's first
    reset = stream_perplexity(model, tokenizer, books, policy="sink", cache_size=16, chunk_size=8, reset_per_book=True)
    assert reset.predicted == sum(lengths) - 2  # every token but each book's first
    alone = [stream_perplexity(model, tokenizer, [b], policy="sink", cache_size=16, chunk_size=8) for b in books]
    assert reset.nll_sum == pytest.approx(sum(r.nll_sum for r in alone), rel=1e-6)


@pytest.mark.parametrize("reset_per_book", [False, True])
@pytest.mark.parametrize("span", [16, None], ids=["one-forward-per-chunk", "scanned"])
def test_checkpoint_resume_is_bit_identical(tmp_path, reset_per_book, span):
    model, tokenizer = tiny_model("llama", init_std=0.2), char_tokenizer()
    books = [TEXT[:700], TEXT[:333], TEXT[:900]]
    pieces = lambda: token_pieces(books, tokenizer)  # noqa: E731

    def make():
        return PerplexityRun(
            model,
            make_policy("h2o", 24),
            chunk_size=16,
            span=span,
            reset_per_book=reset_per_book,
            curve_every=100,
        )

    whole = make()
    whole.run(pieces())
    first, saved = make(), []

    def checkpoint_then_die(run):
        run.save(tmp_path / "c.ckpt")
        saved.append(run.position)
        if run.position > 1100:  # mid-stream, in the third book
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        first.run(pieces(), checkpoint=checkpoint_then_die)
    resumed = make()
    resumed.load(tmp_path / "c.ckpt")
    assert resumed.position == saved[-1] > 1100 and saved[-1] < whole.position - 100
    resumed.run(pieces())
    assert resumed.nll_sum.item() == whole.nll_sum.item()
    assert resumed.predicted == whole.predicted and resumed.curve == whole.curve


# -- the CLI ------------------------------------------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path):
    return write_corpus(tmp_path / "corpus.jsonl")


def run_cli(args, capsys):
    return ppl(capsys, *args)


def test_ppl_command_writes_results_plot_and_table(ppl_model_dir, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, stderr = run_cli(
        [
            "--model",
            ppl_model_dir,
            "--data",
            corpus,
            "--tokens",
            2000,
            "--policy",
            "h2o,sink",
            "--cache-size",
            "16,32",
            "--chunk-size",
            16,
            "--out",
            out,
        ],
        capsys,
    )
    assert code == 0, stderr
    assert "h2o(heavy=8, recent=8)" in stderr and "sink(sinks=4, recent=12)" in stderr
    for name in ("h2o-16", "h2o-32", "sink-16", "sink-32"):
        result = json.loads((out / f"{name}.json").read_text())
        assert result["tokens_fed"] == 2000 and result["predicted_tokens"] == 1999
        assert result["ppl"] == pytest.approx(2.718281828 ** result["mean_nll"])
        assert result["curve"][-1][0] == 1999
    assert (out / "ppl.png").stat().st_size > 10_000
    assert stdout.count("\n") >= 6 and "sink" in stdout


def test_more_tokens_than_the_corpus_runs_what_there_is(ppl_model_dir, corpus, tmp_path, capsys):
    code, _, stderr = run_cli(
        [
            "--model",
            ppl_model_dir,
            "--data",
            corpus,
            "--tokens",
            10**7,
            "--policy",
            "sink",
            "--cache-size",
            16,
            "--chunk-size",
            64,
            "--out",
            tmp_path / "o",
        ],
        capsys,
    )
    assert code == 0
    result = json.loads((tmp_path / "o" / "sink-16.json").read_text())
    assert result["corpus_exhausted"] and "the corpus has only" in stderr
    assert result["tokens_fed"] == sum(len(TEXT[i * 50 :]) + 1 for i in range(3))


def test_sigkill_then_resume_gives_the_same_nll_as_an_uninterrupted_run(ppl_model_dir, corpus, tmp_path):
    args = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        6000,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--checkpoint-every",
        64,
    ]
    command = [sys.executable, "-m", "h2o_stream", "ppl", *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([*command, "--out", tmp_path / "whole"], check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [*command, "--out", killed], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    checkpoint = killed / "h2o-16.ckpt"

    def stamp():
        try:
            return checkpoint.stat().st_ino, checkpoint.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    # Kill it mid-stream, just after a second checkpoint replaced the first (checkpoints every 64 of 6,000 tokens):
    # a fixed sleep let a fast machine finish the whole run first.
    deadline, first = time.time() + 120, None
    while time.time() < deadline and (first is None or stamp() == first):
        first = first or stamp()
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (killed / "h2o-16.json").exists(), "the run finished before it could be killed"
    subprocess.run([*command, "--out", killed, "--resume"], check=True, env=env, capture_output=True)

    whole = json.loads((tmp_path / "whole" / "h2o-16.json").read_text())
    resumed = json.loads((killed / "h2o-16.json").read_text())
    assert resumed["nll_sum"] == whole["nll_sum"] and resumed["predicted_tokens"] == whole["predicted_tokens"]


def test_extending_a_finished_run_equals_one_uninterrupted_run(ppl_model_dir, corpus, tmp_path, capsys):
    # h2o's chunk may not exceed its cache (the engine refuses it): cache 16, chunk 16
    base = ["--model", ppl_model_dir, "--data", corpus, "--policy", "h2o", "--cache-size", 16, "--chunk-size", 16]
    assert run_cli([*base, "--tokens", 2000, "--out", tmp_path / "whole"], capsys)[0] == 0
    extended = tmp_path / "extended"
    assert run_cli([*base, "--tokens", 1000, "--out", extended], capsys)[0] == 0  # 1000 is not a multiple of 16
    short = json.loads((extended / "h2o-16.json").read_text())
    assert short["tokens_fed"] == 1000
    assert run_cli([*base, "--tokens", 2000, "--out", extended, "--resume"], capsys)[0] == 0
    whole = json.loads((tmp_path / "whole" / "h2o-16.json").read_text())
    longer = json.loads((extended / "h2o-16.json").read_text())
    assert longer["nll_sum"] == whole["nll_sum"] and longer["tokens_fed"] == whole["tokens_fed"] == 2000


def _error(args, capsys):
    code, _, stderr = run_cli(args, capsys)
    assert code == 2, stderr
    last = stderr.strip().splitlines()[-1]  # progress lines may come first; the error is one line, no traceback
    assert last.startswith("Error: ") and "Traceback" not in stderr, stderr
    return last


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"\x00\x01\x02binary\xff", "not UTF-8"),
        (b'{"short_book_title": "x", "body": "no text field"}\n', "text"),
    ],
)
def test_bad_corpus_files(ppl_model_dir, tmp_path, capsys, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content)
    assert message in _error(["--model", ppl_model_dir, "--data", path, "--out", tmp_path / "o"], capsys)
    assert not (tmp_path / "o").exists()


def test_corrupt_gguf_model(corpus, tmp_path, capsys):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert "GGUF" in _error(["--model", bad, "--data", corpus, "--out", tmp_path / "o"], capsys)


def test_directory_without_usable_files(ppl_model_dir, tmp_path, capsys):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.csv").write_text("a,b")
    assert "no usable files" in _error(
        ["--model", ppl_model_dir, "--data", tmp_path / "d", "--out", tmp_path / "o"], capsys
    )


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tokens", 0], "--tokens"),
        (["--cache-size", 0], "--cache-size must be at least 1"),
        (["--cache-size", "16", "--recent", 20], "cannot exceed"),
        (["--policy", "lru"], "unknown policy"),
        (["--sinks", -1, "--policy", "sink"], "sinks"),
        (["--chunk-size", 0], "chunk"),
        (["--chunk-size", 8, "--span", 12], "--span must be a positive multiple of the chunk size (8)"),
        (["--span", 0], "--span must be at least 1, got 0"),
        (
            ["--policy", "h2o", "--cache-size", 64, "--span", 6],
            "--span 6 is not a multiple of the chunk size of h2o-64 (4)",
        ),
        (["--model", "/no/such/model"], "not found"),
    ],
)
def test_bad_options(ppl_model_dir, corpus, tmp_path, capsys, args, message):
    base = ["--model", ppl_model_dir, "--data", corpus, "--out", tmp_path / "o"]
    assert message in _error(base + args, capsys)


def test_resume_refuses_corrupt_or_mismatched_checkpoints_and_overwrites_nothing(
    ppl_model_dir, corpus, tmp_path, capsys
):
    out = tmp_path / "o"
    base = [
        "--model",
        ppl_model_dir,
        "--data",
        corpus,
        "--tokens",
        300,
        "--policy",
        "h2o",
        "--cache-size",
        16,
        "--chunk-size",
        8,
        "--out",
        out,
    ]
    assert run_cli(base, capsys)[0] == 0
    assert "--resume" in _error(base, capsys)  # a second run into the same --out without --resume
    checkpoint = out / "h2o-16.ckpt"
    before = checkpoint.read_bytes()
    assert "chunk_size" in _error(base[:-4] + ["--chunk-size", 4, "--out", out, "--resume"], capsys)
    assert checkpoint.read_bytes() == before
    checkpoint.write_bytes(b"garbage")
    assert "corrupt" in _error(base + ["--resume"], capsys)
    assert checkpoint.read_bytes() == b"garbage"
