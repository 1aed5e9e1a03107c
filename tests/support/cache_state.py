"""A cache's state before and after a call it refuses: a refusal leaves every layer as it was."""

from __future__ import annotations

import torch

from h2o_stream import StreamingCache


def snapshot(cache: StreamingCache) -> list[dict]:
    return [layer.state() for layer in cache.layers]


def assert_untouched(cache: StreamingCache, before: list[dict]) -> None:
    for layer, state in zip(cache.layers, before, strict=True):
        for key, value in layer.state().items():
            same = torch.equal(value, state[key]) if isinstance(value, torch.Tensor) else value == state[key]
            assert same, key
