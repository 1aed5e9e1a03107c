"""The three places a model can come from: a model directory, a .gguf file, or the Hugging Face Hub.

Each loader returns `(model, tokenizer)` in the requested dtype on the CPU, and turns the failures a user can
cause (a wrong path, a broken file, no network) into one-line `H2OStreamError`s that say what to do.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import urllib.parse
from pathlib import Path

import torch
from safetensors import SafetensorError

from h2o_stream.errors import H2OStreamError, one_line

# transformers is imported inside the functions that need it: a command that never loads a model never pays for it.

_HUB_PROBE_SECONDS = 3.0  # how long the Hub's host gets to accept a connection before we call it unreachable

# Any of these in a directory means a tokenizer was saved there (fast, then the slow formats).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def from_directory(path: Path, dtype: torch.dtype, *, rust_tokenizer: bool = False):
    """(model, tokenizer) from a directory written by `save_pretrained`. With `rust_tokenizer` the tokenizer is
    read from its tokenizer.json by the `tokenizers` library alone (`rust_tokenizer_of`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = (
            f"to use the GGUF file in it, pass {ggufs[0]}"
            if ggufs
            else "pass a directory written by save_pretrained, or a .gguf file"
        )
        raise H2OStreamError(f"{path} is not a model directory, it has no config.json: {hint}")
    # The tokenizer first: it is quick, so a directory without one fails before the weights load.
    # Without any tokenizer file, transformers' own complaint is a paragraph about sentencepiece.
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise H2OStreamError(
            f"{path} has no tokenizer (no tokenizer.json): save one there with tokenizer.save_pretrained"
        )
    try:
        tokenizer = rust_tokenizer_of(path) if rust_tokenizer else AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise H2OStreamError(
            f"could not load a tokenizer from {path} ({one_line(exc)}): save one there with tokenizer.save_pretrained"
        ) from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as exc:
        raise H2OStreamError(f"could not load the model in {path}: {one_line(exc)}") from exc
    return model, tokenizer


def from_gguf(path: Path, dtype: torch.dtype):
    """(model, tokenizer) from a .gguf file, dequantized to plain `dtype` weights."""
    _require_gguf_package()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # transformers looks `gguf_file` up relative to the working directory before the directory
    # argument, so a relative name could pick up a different file: pass the absolute path.
    gguf_file = str(path.resolve())
    try:
        tokenizer = AutoTokenizer.from_pretrained(pretrained_model_name_or_path=path.parent, gguf_file=gguf_file)
        # dequantize=True gives plain nn.Linear layers and the usual attention: with the optional
        # `kernels` package installed, transformers would otherwise keep the weights packed and
        # swap in a GGML attention, which the KV-cache policies are not written for.
        model = AutoModelForCausalLM.from_pretrained(
            pretrained_model_name_or_path=path.parent,
            gguf_file=gguf_file,
            dtype=dtype,
            quantization_config=GgufConfig(dequantize=True),
        )
    except Exception as exc:  # the GGUF parser raises anything from ValueError to struct.error on a bad file
        raise _gguf_load_error(path, exc) from exc
    return model, tokenizer


_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "sep_token", "cls_token")


def rust_tokenizer_of(path: Path):
    """The tokenizer saved in `path` as a plain fast tokenizer: its tokenizer.json read by the `tokenizers` library,
    its special tokens and chat template from beside it. transformers' own loader rebuilds the vocabulary in
    Python first at every start (Gemma 3: 262k tokens), to the same tokens; a converted copy is checked
    to tokenize as its GGUF does with this loader (default_model.py)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    config_file, template = path / "tokenizer_config.json", path / "chat_template.jinja"
    config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    given = {k: config[k] for k in (*_SPECIAL_TOKENS, "model_max_length") if isinstance(config.get(k), (str, int))}
    try:
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises a bare Exception for a file it cannot parse
        raise ValueError(f"tokenizer.json is not readable: {one_line(exc)}") from exc
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **given)
    if template.is_file():
        tokenizer.chat_template = template.read_text(encoding="utf-8")
    elif isinstance(config.get("chat_template"), str):
        tokenizer.chat_template = config["chat_template"]
    return tokenizer


def from_hub(repo_id: str, dtype: torch.dtype):
    """(model, tokenizer) for a Hugging Face Hub id, downloaded into (or read from) the Hub's own cache."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    unreachable = hub_unreachable()
    local = {"local_files_only": True} if unreachable else {}  # offline: the Hub's cache only, no retries
    try:
        tokenizer = AutoTokenizer.from_pretrained(repo_id, **local)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype, **local)
    except _hub_errors() as exc:
        if unreachable:
            raise H2OStreamError(
                f"could not load the model {repo_id!r}: the Hugging Face Hub is not available ({unreachable}) and the "
                "model is not in the local Hugging Face cache; pass a local directory or a .gguf file with --model"
            ) from exc
        raise H2OStreamError(
            f"could not load the model {repo_id!r} from the Hugging Face Hub: {one_line(exc)} "
            "(if you are offline, pass a local directory or a .gguf file with --model)"
        ) from exc
    except ValueError as exc:  # it downloaded, but is not something AutoModelForCausalLM can build
        raise H2OStreamError(f"could not load the model {repo_id!r}: {one_line(exc)}") from exc
    return model, tokenizer


def hub_unreachable() -> str | None:
    """Why the Hugging Face Hub cannot be used now, or None if it may be: offline mode is on (HF_HUB_OFFLINE or
    TRANSFORMERS_OFFLINE), or the Hub's host does not accept a connection within a few seconds (no network, no DNS).
    Checked before going to the Hub, so that an offline machine fails at once with the reason instead of after the
    Hub client's retries. Behind a proxy only the proxy knows, so the download is left to try."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or any(
        os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    ):
        return "offline mode is on: HF_HUB_OFFLINE is set"
    if any(os.environ.get(name) for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    endpoint = urllib.parse.urlsplit(constants.ENDPOINT)
    host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=_HUB_PROBE_SECONDS).close()
    except OSError as exc:
        return f"{host} cannot be reached: {exc.strerror or one_line(exc)}"
    return None


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401  (transformers reads .gguf files through it)
    except ImportError:
        raise H2OStreamError("loading a .gguf file needs the `gguf` package: pip install gguf") from None


def _gguf_load_error(path: Path, exc: Exception) -> H2OStreamError:
    """Say whether the file itself is broken, or transformers cannot use a well-formed GGUF."""
    import gguf

    try:
        # Parses the whole header, and checks every tensor lies inside the file: work that grows with the model, so
        # it runs only to explain a failure.
        gguf.GGUFReader(path)
    except Exception:  # noqa: BLE001 - whatever the reader raises, the file is not readable GGUF
        return H2OStreamError(
            f"{path} is not a readable GGUF file ({one_line(exc)}): it may be truncated or corrupt; download it again"
        )
    return H2OStreamError(f"transformers could not load the GGUF file {path}: {one_line(exc)}")


def _hub_errors() -> tuple[type[BaseException], ...]:
    """The exceptions that mean the Hub could not be reached, or has no such repository."""
    # transformers turns most of them (no network, missing repo, malformed id) into OSError, and
    # huggingface_hub's HTTP errors and requests' errors are OSErrors too. httpx's are not, and
    # huggingface_hub uses httpx (renamed httpx2 in huggingface_hub 2.x) for its requests.
    errors: list[type[BaseException]] = [OSError]
    for module_name in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):  # that client is not installed, or has no HTTPError
            errors.append(importlib.import_module(module_name).HTTPError)
    return tuple(errors)
