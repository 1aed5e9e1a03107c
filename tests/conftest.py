"""Shared test set-up: every test in an empty working directory of its own, an environment without the user's
Hugging Face or h2o-stream settings and a model cache of its own (the slow tests share the real models, fetched
once); one torch thread count, no autograd; the tiny chat-style model every chat/summarize test uses (a byte-level
BPE tokenizer with SmolLM2's chat template and a random llama sized to it), saved as a model directory and as a GGUF
file; and the character-tokenizer model directory of the ppl tests."""

import os
import shutil
import sys
import tempfile
from pathlib import Path

#: the user's settings that change what huggingface_hub, transformers or h2o-stream do (HF_HUB_OFFLINE=1 makes a
#: missing model an "offline mode" error, H2O_STREAM_COMPILED=0 switches the compiled loop off): no test sees them
USER_SETTINGS = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "H2O_STREAM_")
#: kept: where the default model was converted once (the slow tests load it from there instead of downloading it)
KEPT_SETTINGS = frozenset({"H2O_STREAM_CACHE"})


def users_setting(name: str) -> bool:
    """Whether the environment variable `name` is one of the user's settings that tests run without."""
    return name.startswith(USER_SETTINGS) and name not in KEPT_SETTINGS


# Removed before anything imports huggingface_hub, which reads HF_HUB_OFFLINE, HF_HOME, ... once, at import.
for _name in [name for name in os.environ if users_setting(name)]:
    del os.environ[_name]
#: what every test runs with instead: a Hugging Face cache of the test run's own (empty: nothing the user has
#: downloaded changes an outcome, and nothing is written into the user's cache) and no chat history file
TEST_SETTINGS = {"HF_HOME": tempfile.mkdtemp(prefix="h2o-stream-tests-hf-"), "H2O_STREAM_CHAT_HISTORY": ""}
os.environ.update(TEST_SETTINGS)

import pytest  # noqa: E402  (after the environment is cleaned)
import torch  # noqa: E402

# tests/ itself: the shared helpers are the package `support` (tests/support/), imported as `support.<module>` from
# the test files in every subject's folder (engine/, policies/, apps/<app>/, cli/, models/, eval/)
sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)

from support.model_files import write_tiny_gguf  # noqa: E402  (needs the path above)
from support.tiny_models import bpe_tokenizer, save_tiny_model_dir, tiny_llama  # noqa: E402

#: what the tiny BPE tokenizer is trained on unless a test module sets TRAINING_TEXTS
DEFAULT_TRAINING_TEXTS = [
    "hello world, what is two plus two? the answer is four.",
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
    "user assistant system",
]


#: marker -> (the option that runs its tests, what they run): the real named models, too slow for the default run
REAL_MODELS = {
    "gemma": ("--gemma", "the real Gemma 3 270M (fetched once; about half an hour on 2 cores)"),
    "qwen": ("--qwen", "the real Qwen2.5-Coder-1.5B-Instruct (fetched once, 1.1 GB; about half an hour on 2 cores)"),
}


def pytest_addoption(parser):
    for option, runs in REAL_MODELS.values():
        parser.addoption(option, action="store_true", help=f"also run the checks on {runs}")


def pytest_collection_modifyitems(config, items):
    """The tests of a real named model only with its option: each takes about half an hour on 2 cores, where the
    rest of the suite takes a quarter; `python -m eval quality equivalence` commits the same measurement."""
    for marker, (option, runs) in REAL_MODELS.items():
        if config.getoption(option):
            continue
        skip = pytest.mark.skip(reason=f"{runs}: run with {option}")
        for item in items:
            if item.get_closest_marker(marker):
                item.add_marker(skip)


def pytest_unconfigure(config):
    shutil.rmtree(TEST_SETTINGS["HF_HOME"], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _session_working_directory(tmp_path_factory):
    """Module- and session-scoped fixtures, too, run in an empty directory rather than wherever pytest started."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("session-cwd"))
        yield


@pytest.fixture(autouse=True)
def _hermetic(monkeypatch, tmp_path_factory):
    """Each test in an empty working directory of its own (not `tmp_path`, which tests list), with the cleaned
    environment: anything a test or the code under test set in os.environ is gone again for the next test."""
    for name in [name for name in os.environ if users_setting(name)]:
        monkeypatch.delenv(name)
    for name, value in TEST_SETTINGS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


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


@pytest.fixture(autouse=True)
def _threads_back():
    """What a test sets torch's thread count to (the eval suites do) is undone after it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, model):
    """`model` as the only file of a directory: tiny.gguf."""
    return write_tiny_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A tiny random llama with a character tokenizer, as a model directory's path: what the eval suites run."""
    return str(save_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model"))


@pytest.fixture(scope="module")
def ppl_model_dir(tmp_path_factory):
    """A tiny llama with a character tokenizer (it adds a BOS), as a model directory: what the ppl tests run."""
    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny-ppl-model"), init_std=0.2)
