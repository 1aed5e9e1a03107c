"""The policy zoo on the command line: setting options generated from the registry (--alpha, --per-head), refused
where no chosen policy takes them, recorded in the results; policies that need the tokenizer (sepllm) built once the
model is loaded, in ppl, chat and summarize."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from h2o_stream.cli import main
from h2o_stream.cli.chat import chat
from h2o_stream.cli.summarize import summarize as summarize_command
from support.chat_helpers import TRAINING_TEXTS  # noqa: F401  (conftest's tokenizer is trained on these)
from support.policy_matrix import ALL
from support.ppl_helpers import ppl, ppl_error, result, write_corpus

torch.set_num_threads(1)

ZOO = "tova,a2sf,h2o_sinks,sepllm,keydiff"


@pytest.fixture
def base(ppl_model_dir, tmp_path):
    return [
        "--model",
        ppl_model_dir,
        "--data",
        write_corpus(tmp_path / "corpus.jsonl"),
        "--tokens",
        60,
        "--chunk-size",
        8,
        "--cache-size",
        16,
        "--out",
        tmp_path / "out",
    ]


def test_ppl_runs_every_registered_policy_and_records_its_settings(base, tmp_path, capsys):
    # pyramid's highest layer keeps only 2 of 16 at beta 20, fewer than a chunk of 8: beta 2 leaves it 9
    code, out, err = ppl(
        capsys, *base, "--policy", ",".join(ALL), "--alpha", 0.9, "--per-head", "--beta", 2, "--retrieval-heads", "1.0"
    )
    assert code == 0, err
    runs = [json.loads(path.read_text()) for path in (tmp_path / "out").glob("*.json") if path.name != "summary.json"]
    results = {record["settings"]["policy"]: record for record in runs}
    assert sorted(results) == sorted(ALL) and len(runs) == len(ALL)
    settings = {name: record["settings"] for name, record in results.items()}
    assert settings["a2sf"]["alpha"] == 0.9 and settings["tova"]["per_head"] is True
    assert settings["tova"]["states"] == 16 and settings["a2sf"]["heavy"] + settings["a2sf"]["recent"] == 16
    assert settings["sepllm"]["separator_ids"]  # the char tokenizer's '.', ',' and ' ' are separators
    assert "alpha" not in settings["tova"] and "per_head" not in settings["a2sf"]
    assert settings["pyramid"]["beta"] == 2 and "beta" not in settings["snapkv"]
    assert settings["head_hybrid"]["retrieval_heads"] == "1.0" and settings["head_hybrid"]["calibrated_for"] == ""
    for name, record in results.items():
        assert settings[name]["policy"] == name and record["predicted_tokens"] == 59, record


def test_settings_default_when_not_given(base, tmp_path, capsys):
    code, _, err = ppl(capsys, *base, "--policy", "tova,a2sf")
    assert code == 0, err
    assert result(tmp_path / "out", "a2sf-16")["settings"]["alpha"] == 0.95
    assert result(tmp_path / "out", "tova-16")["settings"]["per_head"] is False


def test_a_bad_setting_value_is_one_error_line(base, tmp_path, capsys):
    message = ppl_error(capsys, *base, "--policy", ZOO, "--alpha", 1.5)
    assert "alpha (the a2sf forgetting factor) must be a number in (0, 1], got 1.5" in message
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--kernel", 0, "kernel must be an odd whole number in (0, 4095], got 0"),
        ("--kernel", 4, "kernel must be an odd whole number in (0, 4095], got 4"),
        ("--beta", 0, "beta must be a whole number in (0, 1000], got 0"),
    ],
)
def test_a_bad_snapkv_or_pyramid_setting_is_one_error_line(base, tmp_path, capsys, option, value, message):
    assert message in ppl_error(
        capsys, *base, "--policy", "snapkv,pyramid" if option == "--kernel" else "pyramid", option, value
    )
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_pyramid_layer_narrower_than_the_chunk_is_one_error_line(base, capsys):
    message = ppl_error(capsys, *base, "--policy", "pyramid")  # beta 20: the highest layer keeps 2 of 16
    assert "a chunk size of at most its smallest layer's budget (2)" in message


@pytest.mark.parametrize("policies, option, value", [("a2sf", "--per-head", None), ("h2o,tova", "--alpha", 0.5)])
def test_a_setting_no_chosen_policy_takes_is_refused(base, capsys, policies, option, value):
    args = [option] if value is None else [option, value]
    message = ppl_error(capsys, *base, "--policy", policies, *args)
    assert f"{option} does not apply to {policies.replace(',', ', ')}" in message


def test_a_bad_sepllm_part_is_refused_before_the_first_run(base, tmp_path, capsys):
    message = ppl_error(capsys, *base, "--policy", "h2o,sepllm", "--separators", 40)
    assert "separators (40) cannot exceed the cache size (16)" in message
    assert not list((tmp_path / "out").glob("*.json")), "a run ran before the check"


def test_help_lists_the_settings_with_their_declarations(capsys):
    code, out, _ = ppl(capsys, "--help")
    assert code == 0
    assert "--alpha FLOAT" in out and "--per-head" in out and "forgetting factor" in out


def test_chat_accepts_sepllm(model_dir, monkeypatch):
    monkeypatch.setenv("H2O_STREAM_CHAT_HISTORY", "")
    args = ["--model", model_dir, "--policy", "sepllm", "--cache-size", 16, "--max-new-tokens", 3, "--seed", 1]
    result_ = CliRunner().invoke(chat, [str(a) for a in args], input="hello world, two plus two?\n/stats\n")
    assert result_.exit_code == 0, (result_.stdout, result_.stderr)
    assert "sepllm(sinks=4, separators=3, recent=9" in result_.stderr


def test_chat_refuses_a_setting_its_policy_does_not_take(model_dir, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["chat", "--model", str(model_dir), "--policy", "h2o", "--alpha", "0.5"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and lines[-1] == "Error: the h2o policy takes heavy, recent; it does not take alpha"
    assert not any(line.startswith("loading") for line in lines), "the model loaded before the check"


def test_summarize_accepts_sepllm(model_dir, tmp_path):
    source = tmp_path / "doc.txt"
    source.write_text("hello world, what is two plus two? the answer is four. " * 8, encoding="utf-8")
    args = [
        source,
        "--model",
        model_dir,
        "--threads",
        1,
        "--policy",
        "sepllm",
        "--cache-size",
        24,
        "--chunk-size",
        8,
        "--max-new-tokens",
        3,
    ]
    result_ = CliRunner().invoke(summarize_command, [str(a) for a in args])
    assert result_.exit_code == 0, (result_.stdout, result_.stderr)
    assert "sepllm" in result_.stderr
