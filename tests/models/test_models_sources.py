"""Tests for h2o_stream.loading.sources through load_model: a model directory, a .gguf file, the Hub, and the errors
users see when one fails.

Everything runs offline on the tiny model and tokenizer from conftest.py; the GGUF file is written in the test with the
`gguf` package. Only the edges are faked: the Hub, and the `gguf` import.
"""

import gc
import random
import shutil
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import LlamaForCausalLM

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading import sources
from h2o_stream.loading.models import load_model
from support.model_files import logits

TEXT = "hello world, what is two plus two?"


# --- model directories ----------------------------------------------------------------------------


def test_a_directory_without_config(tmp_path):
    with pytest.raises(H2OStreamError, match="not a model directory, it has no config.json"):
        load_model(str(tmp_path))


def test_a_directory_holding_only_a_gguf_points_at_the_file(tiny_gguf):
    with pytest.raises(H2OStreamError, match=f"it has no config.json: to use the GGUF file in it, pass {tiny_gguf}"):
        load_model(str(tiny_gguf.parent))


def test_a_directory_without_a_tokenizer(tmp_path, model):
    model.save_pretrained(tmp_path)
    with pytest.raises(H2OStreamError, match="has no tokenizer .*tokenizer.save_pretrained"):
        load_model(str(tmp_path))


def test_a_directory_with_broken_weights(model_dir, tmp_path):
    broken = shutil.copytree(model_dir, tmp_path / "broken")  # a copy: model_dir is shared by the module's tests
    (broken / "model.safetensors").write_bytes(b"not safetensors" * 10)
    with pytest.raises(H2OStreamError, match=f"could not load the model in {broken}: "):
        load_model(str(broken))


def test_a_model_directory_loads_with_the_same_logits(model_dir, model, tokenizer, monkeypatch):
    thread_counts = []
    real_set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (thread_counts.append(n), real_set_num_threads(n)))
    loaded = load_model(model_dir, threads=1)

    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.name == str(model_dir)
    assert loaded.model.dtype == torch.float32
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert thread_counts == [1]
    assert torch.equal(logits(loaded.model), logits(model))
    assert loaded.tokenizer(TEXT).input_ids == tokenizer(TEXT).input_ids


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's memory map (Linux)")
def test_a_model_directory_is_copied_out_of_its_mapped_weights_file(model_dir, model):
    weights = str((Path(model_dir) / "model.safetensors").resolve())
    loaded = load_model(model_dir)
    gc.collect()
    assert weights not in Path("/proc/self/maps").read_text()  # no tensor of the model still reads the file
    assert torch.equal(logits(loaded.model), logits(model))
    if loaded.model.config.tie_word_embeddings:  # a copy per tensor, not per name: tied weights stay one tensor
        assert loaded.model.get_output_embeddings().weight is loaded.model.get_input_embeddings().weight


def test_a_model_directory_loads_in_the_requested_dtype(model_dir, model):
    loaded = load_model(str(model_dir), dtype="bf16")
    assert loaded.model.dtype == torch.bfloat16
    torch.testing.assert_close(logits(loaded.model).float(), logits(model), atol=0.1, rtol=0.1)


# --- GGUF files -----------------------------------------------------------------------------------


def test_a_gguf_file_loads_with_the_same_logits(tiny_gguf, model):
    loaded = load_model(str(tiny_gguf))

    assert loaded.name == str(tiny_gguf)
    assert loaded.model.config.num_key_value_heads == 2
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert torch.equal(logits(loaded.model), logits(model))
    ids = loaded.tokenizer("the in", add_special_tokens=False).input_ids
    assert loaded.tokenizer.convert_ids_to_tokens(ids) == ["the", "Ġ", "in"]


def test_a_gguf_file_relative_to_the_working_directory(tiny_gguf, model, monkeypatch):
    monkeypatch.chdir(tiny_gguf.parent)
    assert torch.equal(logits(load_model(tiny_gguf.name).model), logits(model))


def test_a_file_of_random_bytes_is_not_a_readable_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(random.Random(0).randbytes(8192))
    with pytest.raises(H2OStreamError, match=f"^{junk} is not a readable GGUF file .*download it again"):
        load_model(str(junk))


@pytest.mark.parametrize("keep", ["first 4 KB", "first half", "all but 100 bytes"])
def test_a_truncated_gguf_is_not_a_readable_gguf(keep, tiny_gguf, tmp_path):
    data = tiny_gguf.read_bytes()
    size = {"first 4 KB": 4096, "first half": len(data) // 2, "all but 100 bytes": len(data) - 100}[keep]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:size])
    with pytest.raises(H2OStreamError, match=f"^{cut} is not a readable GGUF file .*truncated or corrupt"):
        load_model(str(cut))


def test_gguf_needs_the_gguf_package(tiny_gguf, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # makes `import gguf` raise ImportError
    with pytest.raises(H2OStreamError, match=r"needs the `gguf` package: pip install gguf"):
        load_model(str(tiny_gguf))


# --- the Hub: faked at transformers' from_pretrained, the boundary (no network in tests) -----------


def _httpx_connect_error():
    for name in ("httpx2", "httpx"):
        try:
            return __import__(name).ConnectError("[Errno -2] Name or service not known")
        except ImportError:
            pass
    pytest.skip("neither httpx2 nor httpx is installed")


@pytest.mark.parametrize(
    "error",
    [
        lambda: OSError("We couldn't connect to 'https://huggingface.co' to load the files.\nCheck your connection."),
        _httpx_connect_error,
    ],
    ids=["OSError", "httpx.ConnectError"],
)
def test_the_hub_unreachable(error, monkeypatch):
    # The transformers boundary fails here, after the connectivity probe let the download try (the probe's own
    # fail-fast path is tested in test_ppl_options.py); on a machine without network the probe would answer first.
    monkeypatch.setattr(sources, "hub_unreachable", lambda: None)

    def unreachable(*args, **kwargs):
        raise error()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", unreachable)
    with pytest.raises(H2OStreamError) as caught:
        load_model("someone/some-model")
    message = str(caught.value)
    assert "could not load the model 'someone/some-model' from the Hugging Face Hub" in message
    assert str(error()).split("\n")[0] in message
    assert "\n" not in message
    assert "if you are offline, pass a local directory or a .gguf file with --model" in message


def test_a_hub_model_that_is_not_a_causal_lm(monkeypatch, tokenizer):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tokenizer)

    def not_causal(*args, **kwargs):
        raise ValueError("Unrecognized configuration class BertConfig for this kind of AutoModel")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", not_causal)
    with pytest.raises(
        H2OStreamError, match="could not load the model 'bert-base-uncased': Unrecognized configuration"
    ):
        load_model("bert-base-uncased")
