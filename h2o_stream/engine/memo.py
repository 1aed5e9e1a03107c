"""Memoised tensors that every forward may use, whether or not it runs under `torch.inference_mode`.

A StreamingCache's forwards with gradients off run under inference mode (hooks.py), and a tensor made there is an
inference tensor, which a later forward with gradients on may not save for backward (e.g. a rotation table
multiplied with keys that require grad). So what the engine keeps across forwards is made outside inference mode.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: the policy registry loads this module without it
    import torch


def memoised(maxsize: int):
    """`functools.lru_cache(maxsize)` for a function returning tensors, which it makes outside inference mode (and
    without autograd). Never modify the results."""

    def wrap(make):
        @functools.lru_cache(maxsize=maxsize)
        @functools.wraps(make)
        def made(*args, **kwargs):
            with outside_inference_mode():
                return make(*args, **kwargs)

        return made

    return wrap


@contextlib.contextmanager
def outside_inference_mode():
    """A context making ordinary tensors, with autograd off, even inside an inference-mode forward."""
    import torch

    with torch.inference_mode(False), torch.no_grad():
        yield


def ordinary(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or an ordinary copy of it if it is an inference tensor (to keep across forwards)."""
    if not tensor.is_inference():
        return tensor
    with outside_inference_mode():
        return tensor.clone()
