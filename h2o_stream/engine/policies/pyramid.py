"""`pyramid` — PyramidKV (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information
Funneling", arXiv 2406.02069; official code Zefan-Cai/KVCache-Factory, `pyramidkv_utils.py`), in a stream.

SnapKV's scores and cut (`snapkv`: attention from the latest `observation` queries, pooled over `kernel` neighbouring
entries, the last `recent` entries kept) with a budget that shrinks from the lowest layer to the highest: the layers'
`heavy` slots run in equal steps from 2 * heavy - heavy // beta down to heavy // beta, so that all layers together
hold what `heavy` in every layer would (`declarations.pyramid_budgets`; the official code rounds its step down and
holds a little more). The budget given (`--cache-size`) is the mean over the layers; a model's sliding-window layers
keep their window and the schedule spreads over its global layers.

Default settings: the official code's (beta 20; SnapKV's window 32, kernel 5, average pooling), split as `snapkv`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import setting
from .registry import register
from .snapkv import SnapKVPolicy


@register
@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    beta: int = setting(
        20, "how much the highest layer keeps, as a fraction 1/beta of the mean ranked slots", within=(0, 1000)
    )
    name = "pyramid"
    layer_schedule = "pyramid"
