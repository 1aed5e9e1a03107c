"""The chat session file: what /save writes and /load reads back, and every check in between.

A session is a verified file (`h2o_stream.files`, the one format for every file h2o-stream reads back): a header
with its kind, format version, size and sha256, checked before anything is deserialized, then the cache (keys,
values, positions, scores), counters, settings and the sampler's RNG state as plain data (`weights_only`), so
nothing in it is executed. It resumes only with the same model (architecture, dtype, weights), tokenizer and chat
format. `load` checks everything before the session changes at all. Format 1 (before verified files) is recognised
and refused with its own message.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from h2o_stream.engine.cache import StreamingCache
from h2o_stream.engine.policies import EvictionPolicy, policy_class
from h2o_stream.errors import H2OStreamError, one_line
from h2o_stream.files import MAGIC, UnverifiedFile, not_ours, read_verified, write_verified
from h2o_stream.generation import Sampling

from .formats import ChatFormat, chat_format
from .stats import TurnResult

SESSION_FORMAT = "h2o-stream chat session"  # the verified file's kind
SESSION_VERSION = 2  # 1: a torch pickle with an inner digest (before verified files); recognised, not resumed
_HEAD_BYTES = 4096  # enough of a file to tell a verified file, a format-1 session and anything else apart
RECENT_MESSAGES = 6  # messages kept as text (for display after /load); the cache is what the model remembers
_PROBE_TEXT = "Hello, world! 123 Ünïcode ✓"
_COUNTERS = {
    "turns": int,
    "prompt_tokens": int,
    "generated_tokens": int,
    "prompt_seconds": float,
    "generate_seconds": float,
}
_LAYER_KEYS = {"keys", "values", "positions", "scores", "seen", "evicted", "max_keys"}


def model_fingerprint(model) -> dict:
    """What a saved cache depends on: architecture, dtype and (a digest of) the weights."""
    config = model.config.get_text_config(decoder=True)
    embedding = model.get_input_embeddings().weight.detach()
    rows = torch.cat([embedding[:32], embedding[-32:]]).to("cpu", torch.float32).contiguous()
    return {
        "model_type": getattr(config, "model_type", None),
        "hidden_size": getattr(config, "hidden_size", None),
        "num_hidden_layers": getattr(config, "num_hidden_layers", None),
        "num_attention_heads": getattr(config, "num_attention_heads", None),
        "num_key_value_heads": getattr(config, "num_key_value_heads", None),
        "vocab_size": getattr(config, "vocab_size", None),
        "dtype": str(embedding.dtype).removeprefix("torch."),
        "weights": hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16],
        "name": getattr(model.config, "_name_or_path", "") or type(model).__name__,
    }


def tokenizer_fingerprint(tokenizer, fmt: ChatFormat) -> dict:
    """What the saved tokens depend on: vocabulary size, how a probe text tokenizes, the chat format."""
    return {"vocab": len(tokenizer), "probe": fmt.encode(_PROBE_TEXT), "format": fmt.fingerprint()}


class NotReplaced(H2OStreamError):
    """`save` found a file at its path that is not a chat session (`what` completes "<path> ...") and left it there:
    only `force=True` replaces it."""

    def __init__(self, path: Path, what: str):
        super().__init__(
            f"cannot save the session to {path}: it {what}, not a chat session, and is not replaced "
            "unless forced (force=True); choose another file"
        )
        self.path, self.what = path, what


def save(session, path: str | os.PathLike, *, force: bool = False) -> Path:
    """Write `session` (a ChatSession) to `path`, atomically; the path written. A file already at `path` is replaced
    when it is a chat session (an older save); anything else only with `force` (else NotReplaced)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise H2OStreamError(f"cannot save the session to {path}: it is a directory; give a file name")
    if not path.parent.is_dir():
        raise H2OStreamError(f"cannot save the session to {path}: the directory {path.parent} does not exist")
    what = None if force else not_ours(path, SESSION_FORMAT)
    if what is not None:
        raise NotReplaced(path, what)
    state = {
        "model": session.fingerprint,
        "tokenizer": tokenizer_fingerprint(session.tokenizer, session.format),
        "policy": session.cache.policy.settings(),
        "rolling": session.cache.rolling,
        "chunk_size": session.chunk_size,
        "system": session.system,
        "sampling": asdict(session.sampling),
        "rng_state": session.generator.get_state(),
        "counters": session.counters(),
        "recent": session.recent_messages,
        "last_turn": asdict(session.last_turn) if session.last_turn else None,
        "cache": session.cache.state(),
        "saved_at": time.time(),
    }
    try:  # serialized in memory, then written atomically and fsynced: a failed write is an OSError, never half a file
        write_verified(path, SESSION_FORMAT, SESSION_VERSION, state)
    except OSError as error:
        raise H2OStreamError(f"cannot save the session to {path}: {error.strerror or error}") from error
    return path


@dataclass
class Resumed:
    """Everything a session takes over from a file, checked."""

    cache: StreamingCache
    format: ChatFormat
    sampling: Sampling
    chunk_size: int
    generator: torch.Generator
    counters: dict
    recent: deque
    last_turn: TurnResult | None


def load(session, path: str | os.PathLike) -> Resumed:
    """Read and check the file at `path` against `session` (its model, tokenizer, format); H2OStreamError on any
    problem. `session` is not changed."""
    path = Path(path).expanduser()
    state = read(path)
    try:
        counters = check(state, path, session.fingerprint, tokenizer_fingerprint(session.tokenizer, session.format))
        policy = policy_from_settings(state["policy"])
        rolling = state["rolling"]
        if not isinstance(rolling, bool):
            raise ValueError("rolling is not a bool")
        system = state["system"]
        if system is not None and not isinstance(system, str):
            raise ValueError("system is not text")
        try:
            sampling = Sampling(**state["sampling"])
        except H2OStreamError as error:  # a bad setting in the file: say it is the file's
            raise ValueError(str(error)) from None
        chunk_size = state["chunk_size"]
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError("bad chunk size")
        fmt = session.format if system == session.system else chat_format(session.tokenizer, system)
        if fmt.fingerprint() != session.format.fingerprint():
            raise ValueError("the chat format changed")
        cache = new_cache(session.model, policy, rolling)
        check_cache_state(state["cache"], cache, session.model)
        cache.load_state(to_device(state["cache"], session.model.device))
        generator = torch.Generator()
        generator.set_state(state["rng_state"])
        recent = deque(
            ({"role": str(m["role"]), "content": str(m["content"])} for m in state["recent"]), maxlen=RECENT_MESSAGES
        )
        last_turn = TurnResult(**state["last_turn"]) if state["last_turn"] else None
    except H2OStreamError:
        raise
    except Exception as error:
        raise H2OStreamError(
            f"{path} is not a usable chat session (corrupt or from an incompatible h2o-stream): {one_line(error)}"
        ) from error
    return Resumed(cache, fmt, sampling, chunk_size, generator, counters, recent, last_turn)


def read(path: Path) -> dict:
    """The file's contents, if it is an intact h2o-stream chat session of this format version."""
    if not path.exists():
        raise H2OStreamError(f"no session file at {path}")
    if not path.is_file():
        raise H2OStreamError(f"{path} is not a session file (it is a directory)")
    try:
        with open(path, "rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError as error:
        raise H2OStreamError(f"cannot read {path}: {error.strerror or error}") from None
    if not head.startswith(MAGIC):
        if head.startswith(b"PK\x03\x04") and SESSION_FORMAT.encode() in head:  # a torch zip: its pickle comes first
            raise H2OStreamError(
                f"{path} is a chat session saved by an older h2o-stream (session format 1, before "
                f"verified files); this version reads format {SESSION_VERSION} and cannot resume it: "
                "start a new session"
            )
        raise H2OStreamError(
            f"{path} is not a readable chat session: it is not an h2o-stream chat session file (the "
            "file is corrupt or truncated, or was not written by h2o-stream chat's /save)"
        )
    try:
        return read_verified(path, SESSION_FORMAT, SESSION_VERSION)
    except UnverifiedFile as error:
        if error.found_kind is not None and error.found_kind != SESSION_FORMAT:
            raise H2OStreamError(f"{path} is not an h2o-stream chat session: it is a {error.found_kind}") from None
        if error.found_version is not None and error.found_version != SESSION_VERSION:
            raise H2OStreamError(
                f"{path} is a chat session of format version {error.found_version}; this "
                f"h2o-stream reads version {SESSION_VERSION}"
            ) from None
        raise H2OStreamError(
            f"{path} is not a readable chat session: the file {error} (a damaged chat session is "
            "never used: load another file or start a new session)"
        ) from None


def _describe_model(fp: dict) -> str:
    return (
        f"{fp.get('name') or '?'} ({fp.get('model_type')}, {fp.get('num_hidden_layers')} layers, hidden "
        f"{fp.get('hidden_size')}, vocab {fp.get('vocab_size')}, {fp.get('dtype')})"
    )


def check(state: dict, path: Path, model_fp: dict, tokenizer_fp: dict) -> dict:
    """Model, tokenizer and counters of a read session; its counters."""
    if not isinstance(state, dict):
        raise ValueError(f"the file holds a {type(state).__name__}, not a session")
    saved = state["model"]
    if not isinstance(saved, dict):
        raise ValueError("no model fingerprint")
    if {k: v for k, v in saved.items() if k != "name"} != {k: v for k, v in model_fp.items() if k != "name"}:
        same_architecture = all(
            saved.get(k) == model_fp.get(k) for k in model_fp if k not in ("name", "dtype", "weights")
        )
        if same_architecture and saved.get("dtype") != model_fp["dtype"]:
            raise H2OStreamError(
                f"{path} was saved with dtype {saved.get('dtype')}, this session runs "
                f"{model_fp['dtype']}: start the chat with --dtype {saved.get('dtype')} to resume it"
            )
        raise H2OStreamError(
            f"{path} was saved with another model, {_describe_model(saved)}; this session runs "
            f"{_describe_model(model_fp)}. Start the chat with that model to resume it"
        )
    if state["tokenizer"] != tokenizer_fp:
        what = (
            "chat format"
            if isinstance(state["tokenizer"], dict) and state["tokenizer"].get("format") != tokenizer_fp["format"]
            else "tokenizer"
        )
        raise H2OStreamError(f"{path} was saved with a different {what} for this model; it cannot be resumed here")
    counters = state["counters"]
    if set(counters) != set(_COUNTERS) or not all(
        isinstance(counters[k], t) and not isinstance(counters[k], bool) for k, t in _COUNTERS.items()
    ):
        raise ValueError("bad counters")
    if any(counters[k] < 0 for k in counters):
        raise ValueError("negative counters")
    return counters


def policy_from_settings(settings: dict) -> EvictionPolicy:
    """The policy whose `settings()` these are."""
    settings = dict(settings)
    return policy_class(settings.pop("policy"))(**settings)


def new_cache(model, policy: EvictionPolicy, rolling: bool) -> StreamingCache:
    """A chat's cache. Prompts go in wide chunks: each prompt token sees all the cache holds (fair chunks, which cut
    before a chunk so that no query sees more than budget + 1 keys, exist to compare policies' perplexity)."""
    return StreamingCache(model, policy, rolling=rolling, wide_chunks=True)


def check_cache_state(state: dict, cache: StreamingCache, model) -> None:
    """Shapes, dtypes and bookkeeping of a saved cache, against the model it is to be used with."""
    layers = state["layers"]
    if not isinstance(layers, list) or len(layers) != len(cache.layers):
        raise ValueError(
            f"the cache has {len(layers) if isinstance(layers, list) else '?'} layers, the model {len(cache.layers)}"
        )
    config = model.config.get_text_config(decoder=True)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    dtype = model.get_input_embeddings().weight.dtype
    budget = cache.policy.budget
    moments = cache.policy.score_moments  # (2,) for a policy that also sums squared attention (roco)
    shapes = set()
    for layer in layers:
        # sessions saved before the cache counted keys seen lack max_keys
        if not isinstance(layer, dict) or set(layer) | {"max_keys"} != _LAYER_KEYS:
            raise ValueError("a layer has unexpected fields")
        seen, evicted, widest = layer["seen"], layer["evicted"], layer.get("max_keys", 0)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (seen, evicted, widest)):
            raise ValueError("bad layer counters")
        keys, values, positions, scores = (layer[k] for k in ("keys", "values", "positions", "scores"))
        if keys is None:
            if seen or any(t is not None for t in (values, positions, scores)):
                raise ValueError("an empty layer with entries")
            shapes.add((0, seen))
            continue
        if not all(isinstance(t, torch.Tensor) for t in (keys, values, positions, scores)):
            raise ValueError("a layer's entries are not tensors")
        n = keys.shape[2] if keys.dim() == 4 else -1
        if (
            keys.dim() != 4
            or keys.shape[:2] != (1, kv_heads)
            or values.dim() != 4
            or values.shape[:3] != keys.shape[:3]
        ):
            raise ValueError(f"cache tensors of shape {tuple(keys.shape)} do not fit this model")
        if (
            positions.shape != keys.shape[:3]
            or scores.shape != (*keys.shape[:3], *moments)
            or positions.dtype != torch.long
            or not scores.is_floating_point()
        ):
            raise ValueError("cache bookkeeping does not match its entries")
        if keys.dtype != dtype or values.dtype != dtype:
            raise ValueError(f"cache tensors are {keys.dtype}, the model runs {dtype}")
        if (budget is not None and n > budget) or n > seen:
            raise ValueError(f"a layer holds {n} entries (budget {budget}, {seen} seen)")
        shapes.add((n, seen))
    if len(shapes) > 1:
        raise ValueError("layers disagree on their entries")


def to_device(state: dict, device) -> dict:
    """A cache state with its tensors on `device`."""
    return {
        **state,
        "layers": [
            {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in layer.items()}
            for layer in state["layers"]
        ],
    }
