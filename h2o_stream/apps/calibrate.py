"""Head classification for `head_hybrid`: which KV heads read beyond the streaming window, measured on held-out text.

A streaming head keeps the stream's first `sinks` tokens and its newest entries, so at cache size B a query of it sees
the first `sinks` keys and its own last B - sinks + 1; everything between is what only a retrieval head can keep.
Windows of `length` tokens of the text go through the model's own forward (no cache, eager attention, so that the
probabilities come back; sliding-window layers with their own masks). For every query at least B tokens into its
window, the attention mass each query head puts on those older keys (not a sink, not among the query's last
B - sinks + 1), its mean over the queries and windows, then over the query heads reading each KV head, is that KV
head's older mass. Of the layers that run the policy, the heads with the highest older mass (a `share` of them) are
the retrieval heads, the rest streaming. The classification file records the masses, the choice and the model's
signature, so that `head_hybrid` refuses it on another model.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import torch

from h2o_stream.engine.checks import model_signature
from h2o_stream.engine.layer_types import SLIDING_MODES, layer_windows
from h2o_stream.engine.policies.head_hybrid import CLASSIFICATION_KIND, NO_RETRIEVAL, canonical_pairs
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import probe_writable, write_json
from h2o_stream.loading.corpus import book_token_ids, corpus_digest, describe_source, iter_books
from h2o_stream.version import __version__


def check_calibration(cache_size: int, sinks: int, share: float, windows: int, length: int, context: int | None):
    """One clear H2OStreamError for settings that cannot classify anything (before the model runs)."""
    if cache_size < 1 or sinks < 0 or sinks >= cache_size:
        raise H2OStreamError(f"--sinks ({sinks}) must be at least 0 and below --cache-size ({cache_size})")
    if not 0 <= share <= 1:
        raise H2OStreamError(f"--retrieval-share must lie in [0, 1], got {share}")
    if windows < 1:
        raise H2OStreamError(f"--windows must be at least 1, got {windows}")
    if length <= cache_size:
        raise H2OStreamError(
            f"--length ({length}) must exceed --cache-size ({cache_size}): no query would see beyond the window"
        )
    if context is not None and length > context:
        raise H2OStreamError(f"--length ({length}) exceeds the model's context ({context} positions)")


def policy_layers(config, sliding: str = "window") -> list[int]:
    """The model layers that run the chosen policy (engine/layer_types.py): the global layers, or every layer where
    all of them slide or with `sliding` "policy"."""
    if sliding not in SLIDING_MODES:
        raise H2OStreamError(f"sliding layers keep their window or run the policy ({', '.join(SLIDING_MODES)})")
    windows = layer_windows(config)
    if sliding == "policy" or all(window is not None for window in windows):
        return list(range(len(windows)))
    return [i for i, window in enumerate(windows) if window is None]


def held_out_windows(tokenizer, source, books: Iterable[int] | None, windows: int, length: int) -> torch.Tensor:
    """(windows, length) token ids: the chosen books of `source` (all: None), one after another, cut into windows."""
    chosen = None if books is None else set(books)
    ids: list[int] = []
    for index, book in enumerate(iter_books(source)):
        if chosen is None or index in chosen:
            ids.extend(book_token_ids(book, tokenizer))
        if len(ids) >= windows * length:
            return torch.tensor(ids[: windows * length]).view(windows, length)
    raise H2OStreamError(
        f"the calibration text holds {len(ids):,} tokens, fewer than --windows x --length "
        f"({windows} x {length} = {windows * length:,})"
    )


def older_mass(
    model, ids: torch.Tensor, cache_size: int, sinks: int, on_progress: Callable[[int, int], None] | None = None
) -> list[list[float]]:
    """Per model layer and KV head, the mean attention mass a query puts on keys a streaming head of this cache size
    would have evicted (see the module docstring); `ids` (windows, length). `on_progress(done, total)` after each
    window: the tokens read so far, of all the windows'."""
    config = model.config.get_text_config(decoder=True)
    group = config.num_attention_heads // (getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    length = ids.shape[1]
    queries = torch.arange(cache_size, length)
    keys = torch.arange(length)
    distance = queries[:, None] - keys[None, :]
    older = (keys >= sinks)[None, :] & (distance > cache_size - sinks)  # (queries, keys)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the probabilities themselves (the fused kernels do not return them)
    totals: list[torch.Tensor] = []
    try:
        with torch.no_grad():
            for done, window in enumerate(ids, 1):
                attentions = model(window[None], output_attentions=True, use_cache=False).attentions
                for index, layer in enumerate(attentions):
                    per_query_head = (layer[0][:, queries].double() * older).sum(-1).mean(-1)  # (query heads,)
                    per_kv_head = per_query_head.view(-1, group).mean(-1) / len(ids)
                    if len(totals) <= index:
                        totals.append(torch.zeros_like(per_kv_head))
                    totals[index] += per_kv_head
                if on_progress is not None:
                    on_progress(done * length, ids.numel())
    finally:
        model.set_attn_implementation(previous)
    return [[float(x) for x in masses] for masses in totals]


def classify(masses: list[list[float]], layers: list[int], share: float) -> str:
    """The retrieval heads as canonical LAYER.HEAD pairs: of the heads of `layers`, the round(share x their count)
    with the highest older mass (at least one when `share` > 0), ties to the lower layer, then head."""
    heads = [(layer, head) for layer in layers for head in range(len(masses[layer]))]
    count = max(round(share * len(heads)), 1 if share > 0 else 0)
    ranked = sorted(heads, key=lambda pair: (-masses[pair[0]][pair[1]], pair))[:count]
    return canonical_pairs(",".join(f"{layer}.{head}" for layer, head in ranked) or NO_RETRIEVAL)


def calibrate(
    loaded,
    source,
    *,
    cache_size: int = 256,
    sinks: int = 4,
    share: float = 0.5,
    windows: int = 8,
    length: int = 1024,
    books: Iterable[int] | None = None,
    sliding: str = "window",
    on_progress: Callable[[int, int], None] | None = None,
) -> dict:
    """The head classification of `loaded` (a LoadedModel) on the text `source` (books: None for all): the content
    of a classification file (`write_classification`). `on_progress(done, total)`: the tokens read so far, after
    each window."""
    config = loaded.model.config.get_text_config(decoder=True)
    check_calibration(cache_size, sinks, share, windows, length, getattr(config, "max_position_embeddings", None))
    layers = policy_layers(config, sliding)
    ids = held_out_windows(loaded.tokenizer, source, books, windows, length)
    masses = older_mass(loaded.model, ids, cache_size, sinks, on_progress)
    digest = corpus_digest(source)
    return {
        "kind": CLASSIFICATION_KIND,
        "version": 1,
        "model": loaded.name,
        "model_signature": model_signature(config),
        "retrieval_heads": classify(masses, layers, share),
        "settings": {
            "cache_size": cache_size,
            "sinks": sinks,
            "retrieval_share": share,
            "windows": windows,
            "length": length,
            "books": None if books is None else sorted(set(books)),
            "sliding_layers": sliding,
        },
        "data": {
            "source": describe_source(source),
            "bytes": None if digest is None else digest[0],
            "sha256": None if digest is None else digest[1],
        },
        "policy_layers": layers,
        "older_mass": masses,
        "h2o_stream": __version__,
    }


def check_writable(path: str | os.PathLike) -> None:
    """Refuse (before any work) a classification file `path` whose folder is missing or takes no new file: a file is
    created there and removed again."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise H2OStreamError(f"cannot write --out {os.fspath(path)}: the folder {folder} does not exist")
    try:
        probe_writable(folder)
    except OSError as error:
        raise H2OStreamError(
            f"cannot write --out {os.fspath(path)}: no file can be created in {folder} ({error.strerror or error})"
        ) from None


def write_classification(path: str | os.PathLike, classification: dict, *, overwrite: bool = False) -> None:
    """Write `classification` to `path` atomically; an existing file is refused unless `overwrite`."""
    if os.path.exists(path) and not overwrite:
        raise H2OStreamError(f"{os.fspath(path)!r} exists; choose another --out or pass --force to replace it")
    try:
        write_json(path, classification)
    except OSError as error:
        raise H2OStreamError(f"cannot write {os.fspath(path)}: {error.strerror or error}") from None
