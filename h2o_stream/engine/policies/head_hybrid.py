"""`head_hybrid` — one cache budget, two kinds of KV head (the head-level split of DuoAttention, Xiao et al. 2024,
arXiv 2410.10819, official code mit-han-lab/duo-attention; and of FastGen, Ge et al., ICLR 2024), in a stream.

Every KV head keeps the stream's first `sinks` tokens and its last `recent` entries. Between them a head's other
`heavy` slots go by its class: a retrieval head keeps the `heavy` highest-scored older entries (h2o's scores: the
attention received, summed over every step, its query heads summed; ties to the older entry), a streaming head its
newest ones (it keeps sinks + its last heavy + recent entries: StreamingLLM at the same budget). The classes come
from `retrieval_heads`: the retrieval heads as `LAYER.HEAD` pairs (model layer index, KV head index), e.g.
`3.0,7.1`, `*.0` for KV head 0 of every layer that runs the policy, every other head streaming; `none` for no
retrieval head; or a head classification file written by
`h2o-stream calibrate` (the attention mass each head puts beyond the streaming window on held-out text, the highest
heads retrieval), which also names the model it was made on: a cache refuses it on another model.

Where it differs from DuoAttention: there a retrieval head keeps its whole cache, which no bounded stream can; here
every head holds the same budget and a retrieval head ranks by attention instead (FastGen's heavy-hitter head, with
sinks and a recent window). The classification is calibrated from the attention mass beyond the window (the
measurement eval/attention.py makes per layer), not DuoAttention's optimised gates. Default split: h2o_sinks's, 4
sinks, half the cache heavy, the rest recent.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

from h2o_stream.errors import H2OStreamError

from .base import HEAVY, RECENT, SINKS, EvictionPolicy, Scores, setting
from .ranking import HEAD_CLASS
from .registry import register

#: the `kind` of a head classification file (`h2o-stream calibrate`)
CLASSIFICATION_KIND = "h2o-stream head classification"
#: `retrieval_heads` naming no retrieval head: every head streams
NO_RETRIEVAL = "none"


@register
@dataclass
class HeadHybridPolicy(EvictionPolicy):
    sinks: int
    heavy: int
    recent: int
    retrieval_heads: str = setting(
        "",
        "the retrieval heads: a head classification file from h2o-stream calibrate, or LAYER.HEAD pairs "
        "(e.g. 3.0,7.1; *.0: head 0 of every layer), or 'none'; every other KV head streams",
        required=True,
        example="*.0",
        called="a classification file (h2o-stream calibrate writes one) or LAYER.HEAD pairs",
    )
    #: the model a classification file was made on (`engine.checks.model_signature`), "" when given as pairs;
    #: set from the file, never given (make_policy knows no such setting)
    calibrated_for: str = ""
    name = "head_hybrid"
    parts = (SINKS, HEAVY, RECENT)
    scoring = Scores("sum")
    ranking = HEAD_CLASS

    def __post_init__(self):
        super().__post_init__()
        text = self.retrieval_heads.strip()
        if text.endswith(".json") or Path(text).is_file():
            text, self.calibrated_for = read_classification(text)
        self.retrieval_heads = canonical_pairs(text)

    def retrieval_in(self, layer: int) -> tuple[int, ...]:
        """The retrieval KV heads of model layer `layer`, ascending."""
        return _retrieval_in(self.retrieval_heads, layer)

    def fit_model(self, layers: list[int], kv_heads: int, model: str) -> None:
        if self.calibrated_for and self.calibrated_for != model:
            raise H2OStreamError(
                f"the head classification was made on another model ({self.calibrated_for}), not this one "
                f"({model}); run h2o-stream calibrate on this model"
            )
        for layer, heads in retrieval_map(self.retrieval_heads).items():
            if layer != EVERY_LAYER and layer not in layers:
                raise H2OStreamError(
                    f"retrieval head {layer}.{heads[0]}: layer {layer} does not run {self.name} on this model "
                    f"(the layers that do: {_ranges(layers)})"
                )
            if heads[-1] >= kv_heads:
                raise H2OStreamError(
                    f"retrieval head {_layer_text(layer)}.{heads[-1]}: this model's layers have {kv_heads} KV head(s), "
                    f"0..{kv_heads - 1}"
                )


def canonical_pairs(text: str) -> str:
    """`retrieval_heads` as pairs, sorted and once each ('3.1,0.0' -> '0.0,3.1'; every layer's first), or 'none';
    a clear error otherwise."""
    pairs = sorted(_parse_pairs(text))
    return ",".join(f"{_layer_text(layer)}.{head}" for layer, head in pairs) if pairs else NO_RETRIEVAL


@functools.lru_cache(maxsize=64)
def retrieval_map(text: str) -> dict[int, tuple[int, ...]]:
    """Canonical `retrieval_heads` as {layer (EVERY_LAYER for `*`): its retrieval KV heads, ascending}."""
    heads: dict[int, tuple[int, ...]] = {}
    for layer, head in _parse_pairs(text):
        heads[layer] = (*heads.get(layer, ()), head)
    return heads


@functools.lru_cache(maxsize=1024)
def _retrieval_in(text: str, layer: int) -> tuple[int, ...]:
    heads = retrieval_map(text)
    return tuple(sorted({*heads.get(layer, ()), *heads.get(EVERY_LAYER, ())}))


#: the layer of a `*.HEAD` pair: every layer
EVERY_LAYER = -1


def _layer_text(layer: int) -> str:
    return "*" if layer == EVERY_LAYER else str(layer)


def _parse_pairs(text: str) -> list[tuple[int, int]]:
    if text.strip() == NO_RETRIEVAL:
        return []
    pairs = []
    for item in text.split(","):
        layer, dot, head = item.strip().partition(".")
        if not (dot and (layer.isdigit() or layer == "*") and head.isdigit()):
            raise H2OStreamError(
                f"retrieval_heads must be LAYER.HEAD pairs separated by commas (e.g. 3.0,7.1), 'none', or a "
                f"classification file (.json); got {text!r}"
            )
        pairs.append((EVERY_LAYER if layer == "*" else int(layer), int(head)))
    if len(set(pairs)) < len(pairs):
        raise H2OStreamError(f"retrieval_heads names a head twice: {text!r}")
    return pairs


def read_classification(path: str) -> tuple[str, str]:
    """(the retrieval heads, the model's signature) of a head classification file, or one clear error."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise H2OStreamError(f"no head classification file {path!r} (h2o-stream calibrate writes one)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise H2OStreamError(f"{path!r} is not a head classification file: {error}") from None
    if (
        not isinstance(data, dict)
        or data.get("kind") != CLASSIFICATION_KIND
        or not isinstance(data.get("retrieval_heads"), str)
        or not isinstance(data.get("model_signature"), str)
    ):
        raise H2OStreamError(f"{path!r} is not a head classification file (h2o-stream calibrate writes one)")
    return data["retrieval_heads"], data["model_signature"]


def _ranges(layers: list[int]) -> str:
    return ", ".join(str(layer) for layer in layers) if len(layers) <= 8 else f"{layers[0]}..{layers[-1]}"
