"""Tests for h2o_stream.loading.models: the options load_model checks first, and how it tells sources apart.

The sources themselves are tested in test_models_sources.py, the default model in test_models_default.py.
"""

from pathlib import Path

import pytest
import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.models import load_model, resolve_device, resolve_dtype

# --- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("bf16", torch.bfloat16),
        ("BFloat16", torch.bfloat16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
    ],
)
def test_resolve_dtype_accepts_names_and_short_forms(name, dtype):
    assert resolve_dtype(name) is dtype


def test_resolve_dtype_lists_the_choices_for_an_unknown_name():
    with pytest.raises(H2OStreamError, match="unknown dtype 'float8'") as caught:
        resolve_dtype("float8")
    assert all(choice in str(caught.value) for choice in ("float32", "bf16", "float16"))


def test_resolve_device_cpu():
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("name", ["tpu", "gpu", "cpu:0", "cuda:x", ""])
def test_resolve_device_rejects_unknown_names(name):
    with pytest.raises(H2OStreamError, match="unknown device .*choose cpu, cuda, cuda:N"):
        resolve_device(name)


def test_resolve_device_cuda_when_torch_sees_no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(H2OStreamError, match="'cuda:0' is not available here.*use cpu"):
        resolve_device("cuda:0")


def test_resolve_device_cuda_index_past_the_last_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(H2OStreamError, match="'cuda:2' does not exist: 2 CUDA GPU"):
        resolve_device("cuda:2")


def test_resolve_device_mps_when_unavailable(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(H2OStreamError, match="'mps' is not available here"):
        resolve_device("mps")


def test_load_model_checks_its_options_before_looking_for_the_model(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(H2OStreamError, match="unknown dtype"):
        load_model(missing, dtype="float8")
    with pytest.raises(H2OStreamError, match="unknown device"):
        load_model(missing, device="tpu")
    for threads in (0, -2, 1.5, True):
        with pytest.raises(H2OStreamError, match="threads must be a whole number of at least 1"):
            load_model(missing, threads=threads)


# --- telling the sources apart --------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["./nope", "../nope/model", "/no/such/dir/model", "~/no-such-h2o-model", "model.gguf"])
def test_a_local_looking_path_that_does_not_exist(spec, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(H2OStreamError, match="^model not found: ") as caught:
        load_model(spec)
    assert str(Path(spec).expanduser()) in str(caught.value)


def test_an_empty_spec_is_refused_rather_than_loading_the_working_directory():
    with pytest.raises(H2OStreamError, match="empty string"):
        load_model("  ")


def test_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 64)
    with pytest.raises(H2OStreamError, match="is a file but not a .gguf file"):
        load_model(str(tmp_path / "weights.bin"))


@pytest.mark.parametrize("spec", [None, "smollm2", " SmolLM2 "])
def test_the_default_model_is_asked_of_default_model(spec, monkeypatch):
    asked = []

    def load_default(dtype):
        asked.append(dtype)
        raise H2OStreamError("stop here")

    monkeypatch.setattr("h2o_stream.loading.models.load_default", load_default)
    with pytest.raises(H2OStreamError, match="stop here"):
        load_model(spec, dtype="bf16")
    assert asked == [torch.bfloat16]
