"""The names `load_model` accepts for a dtype and a device, checked without torch: a command checks them while it
parses its options, before torch loads (`models.resolve_dtype` and `resolve_device` check them again, and whether the
device is there)."""

from __future__ import annotations

import re

from h2o_stream.errors import H2OStreamError

#: dtype name -> the torch dtype's name
DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

DEVICE_PATTERN = re.compile(r"(cpu|mps|cuda)(?::(\d+))?")


def dtype_name(name: str, label: str = "dtype") -> str:
    """The torch dtype's name for `name` (float32/fp32, bfloat16/bf16, float16/fp16, any case); an H2OStreamError
    naming it as `label` otherwise."""
    try:
        return DTYPES[name.strip().lower()]
    except (KeyError, AttributeError):
        raise H2OStreamError(f"unknown {label} {name!r}: choose one of {', '.join(DTYPES)}") from None


def device_name(name: str, label: str = "device") -> tuple[str, str | None]:
    """(kind, index or None) of the device called `name` (cpu, cuda, cuda:N, mps); an H2OStreamError naming it as
    `label` otherwise."""
    match = DEVICE_PATTERN.fullmatch(str(name).strip().lower())
    if match is None or (match[1] != "cuda" and match[2] is not None):
        raise H2OStreamError(f"unknown {label} {name!r}: choose cpu, cuda, cuda:N (a GPU number) or mps")
    return match[1], match[2]
