"""Load the model and tokenizer to stream with: the default model, a .gguf file, a model directory, or a Hub id.

`load_model` is the one entry point. It checks its options first (dtype, device, threads: `resolve_dtype`,
`resolve_device`), so that a typo fails before the model loads, then dispatches on the spec:
the default model is provisioned by `default_model`, the three kinds of source are read by `sources`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.catalogue import DEFAULT_MODEL, NAMED_MODELS
from h2o_stream.loading.default_model import (
    cache_dir,
    default_gguf_path,
    load_default,
    load_gguf_once,
    load_named,
)
from h2o_stream.loading.names import device_name, dtype_name
from h2o_stream.loading.sources import from_directory, from_hub

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# cache_dir, default_gguf_path and DEFAULT_MODEL live in default_model; callers may import them from here too.
__all__ = [
    "DEFAULT_MODEL",
    "LoadedModel",
    "cache_dir",
    "default_gguf_path",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]


@dataclass
class LoadedModel:
    """A causal LM ready for inference, its tokenizer, and a name to show people and record in results."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # for people: the default model's description, or the path / Hub id that was loaded


# --- options --------------------------------------------------------------------------------------


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype called `name` (float32/fp32, bfloat16/bf16, float16/fp16, any case)."""
    return getattr(torch, dtype_name(name))


def resolve_device(name: str) -> torch.device:
    """The device called `name`, refusing one that this machine's torch cannot use."""
    kind, index = device_name(name)
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
        raise H2OStreamError(
            f"device {name!r} is not available here: torch cannot use Apple's MPS backend on this "
            "machine; use cpu instead"
        )
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

    `spec` is None or "smollm2" for the default model, another named model ("gemma3-270m", "qwen2.5-coder-1.5b":
    NAMED_MODELS), a .gguf file (converted once and cached by its sha256), a model directory, or a Hub id.
    """
    # Check every option before the model loads, so that a typo fails before that work, not after it.
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    torch_device = device if isinstance(device, torch.device) else resolve_device(device)
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise H2OStreamError(f"threads must be a whole number of at least 1, got {threads!r}")
        torch.set_num_threads(threads)

    if spec is not None and not str(spec).strip():
        raise H2OStreamError(
            f"the model to load is an empty string: pass {', '.join(NAMED_MODELS)}, a .gguf file, a model "
            "directory or a Hub id"
        )
    named = None if spec is None else str(spec).strip().lower()
    if spec is None or named == DEFAULT_MODEL:
        model, tokenizer, name = load_default(torch_dtype)
    elif named in NAMED_MODELS and not Path(str(spec)).expanduser().exists():  # a file or folder of that name wins
        model, tokenizer, name = load_named(named, torch_dtype)
    else:
        model, tokenizer, name = _load_spec(str(spec), torch_dtype)
    return LoadedModel(model=_ready_for_inference(model, torch_device), tokenizer=tokenizer, name=name)


def _load_spec(spec: str, dtype: torch.dtype):
    """Tell a local file or directory from a Hub id, and load it."""
    path = Path(spec).expanduser()
    if path.is_dir():
        return (*from_directory(path, dtype), str(path))
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise H2OStreamError(f"{path} is a file but not a .gguf file: pass a .gguf file or a model directory")
        return (*load_gguf_once(path, dtype), str(path))
    if spec.startswith(("/", "./", "../", "~")) or spec.lower().endswith(".gguf"):
        raise H2OStreamError(f"model not found: {path}")
    return (*from_hub(spec, dtype), spec)


def _ready_for_inference(model, device: torch.device):
    try:
        model.to(device)
    except torch.OutOfMemoryError as exc:
        raise H2OStreamError(
            f"the model does not fit in the memory of {device}: use a smaller dtype or another device"
        ) from exc
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        _copy_out_of_mapped_files(model)
    return model


def _copy_out_of_mapped_files(model) -> None:
    """Copy every parameter and buffer into memory of this process's own (the model's values stay as they are).

    transformers leaves the tensors of a .safetensors file memory-mapped from the file, every one of the default
    model's 272 at an address off a 64-byte boundary. Copied out (aligned: torch's allocator gives 64 bytes), every
    tensor the forwards read is aligned and in this process's own memory rather than paged in from the file; the
    copy is made once, at load, and the mapping is released with the last tensor that used it. Tied weights stay
    tied: a shared tensor is one parameter here.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data = tensor.data.clone()
