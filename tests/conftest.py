"""Shared test set-up: one torch thread count, no autograd, a model cache of each test's own, and the tiny
chat-style model every chat/summarize test uses (a byte-level BPE tokenizer with SmolLM2's chat template and a
random llama sized to it)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from tiny_models import bpe_tokenizer, tiny_llama  # noqa: E402  (needs the path above)

#: what the tiny BPE tokenizer is trained on unless a test module sets TRAINING_TEXTS
DEFAULT_TRAINING_TEXTS = ["hello world, what is two plus two? the answer is four.",
                          "You are a helpful AI assistant named SmolLM, trained by Hugging Face", "user assistant system"]


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture(autouse=True)
def _own_model_cache(request, monkeypatch, tmp_path):
    """Every test but the slow ones (which use the real models, fetched once) gets an empty model cache of its own:
    a .gguf a test loads is converted into it, never into the user's."""
    if not request.node.get_closest_marker("slow"):
        monkeypatch.setenv("H2O_STREAM_CACHE", str(tmp_path / "model-cache"))


@pytest.fixture(scope="module")
def tokenizer(request):
    """Tiny BPE tokenizer with SmolLM2's chat template, trained on the module's TRAINING_TEXTS."""
    return bpe_tokenizer(getattr(request.module, "TRAINING_TEXTS", DEFAULT_TRAINING_TEXTS))


@pytest.fixture(scope="module")
def model(tokenizer):
    """A random tiny llama whose vocabulary fits `tokenizer`."""
    return tiny_llama(len(tokenizer))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, model, tokenizer):
    """`model` and `tokenizer` saved as a local model directory, loadable with --model PATH."""
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
