"""A slow, obviously-correct reference for DESIGN.md's exact mode. Tests only.

It runs the model's own layers one token at a time with every position id set to 0, so the model's rotation is the
identity and the attention function receives un-rotated queries and keys. Everything the design specifies is then
done here, plainly: per layer and per KV head a Python list of entries (stream position, key, value, score); each step
the new entry is appended, keys are rotated to their slot and the query to the new slot (plain RoPE, float64), the
softmax probabilities become scores as Python floats (summed, decayed, or the current step's alone; per KV head or
averaged over the layer's heads), and the cut follows the rules word for word.
Covers Llama-style models with default RoPE.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface

_ORACLE_NAME = "h2o_stream_test_oracle"
_running: list[Oracle] = []


@dataclass
class Entry:
    position: int
    key: torch.Tensor  # un-rotated, float64
    value: torch.Tensor
    token: int = -1
    score: float = 0.0
    square: float = 0.0  # roco: the sum of the squares of what each step gave
    history: list = field(default_factory=list)  # "window": (step, what it gave) of every step


def stream_for(policy, length: int, *, seed: int, vocab: int) -> torch.Tensor:
    """(1, length) random token ids for comparing `policy` with the oracle.

    For a policy that ranks keys (keydiff) the tokens are distinct: with rolling, two copies of a token have the
    same un-rotated first-layer key, an exact tie that the engine's stored keys (rotated by the model, un-rotated
    again) break by rounding noise. Which copy survives then changes no output, but the kept positions would not
    be comparable.
    """
    generator = torch.Generator().manual_seed(seed)
    if type(policy).ranking.name in ("key_diversity", "own_score"):
        assert length <= vocab - 2
        return (torch.randperm(vocab - 2, generator=generator)[:length] + 2).unsqueeze(0)
    return torch.randint(2, vocab, (1, length), generator=generator)


def run_against_oracle(spec, kv_heads: int, rolling: bool, *, steps: int):
    """Feed one random stream of `steps` tokens, token by token, through the engine and the oracle on a tiny llama
    with `kv_heads` KV heads; assert equal logits (1e-4) and kept entries of every layer and head at every step, and
    that something was evicted. Returns the engine's cache."""
    from h2o_stream import StreamingCache
    from support.tiny_models import VOCAB, tiny_model

    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2)
    oracle = Oracle.for_policy(model, spec, rolling=rolling)
    cache = StreamingCache(model, spec, rolling=rolling)
    ids = stream_for(spec, steps, seed=kv_heads, vocab=VOCAB)
    for t in range(ids.shape[1]):
        engine_logits = model(ids[:, t : t + 1], cache=cache).logits[0, -1]
        oracle_logits = oracle.step(int(ids[0, t]))
        assert torch.allclose(engine_logits, oracle_logits, atol=1e-4, rtol=0), f"step {t}"
        for layer_idx, layer in enumerate(cache.layers):
            for head in range(kv_heads):
                assert layer.positions[0, head].tolist() == oracle.kept_positions(layer_idx, head), (t, layer_idx)
    assert cache.evicted > 0
    return cache


def first_head_ever_differs(engine_spec, oracle_spec, ids: torch.Tensor) -> bool:
    """Whether the engine running `engine_spec` and the oracle running `oracle_spec` ever keep different entries in
    layer 0, KV head 0, fed `ids` token by token on a tiny llama with 2 KV heads: what shows that a test against the
    oracle can fail."""
    from h2o_stream import StreamingCache
    from support.tiny_models import tiny_model

    model = tiny_model("llama", num_key_value_heads=2, init_std=0.2)
    oracle = Oracle.for_policy(model, oracle_spec)
    cache = StreamingCache(model, engine_spec)
    differs = False
    for t in range(ids.shape[1]):
        model(ids[:, t : t + 1], cache=cache)
        oracle.step(int(ids[0, t]))
        differs |= cache.layers[0].positions[0, 0].tolist() != oracle.kept_positions(0, 0)
    return differs


def rope(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    angle = position * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


@dataclass
class Rules:
    """A policy's declaration as the oracle reads it, plainly: its parts by name in declaration order, how attention
    becomes a score and how the middle entries are ranked."""

    parts: dict[str, int]
    accumulate: str | None  # sum / decay / latest / moments, or None: no scores
    layer_mean: bool  # the layer's mean over every query head, else per KV head (its query heads summed)
    decay: float
    ranking: str | None  # age / score / mean / key_diversity / token_class / pooled / head_class / own_score
    separator_ids: frozenset = frozenset()
    window: int = 0  # "window": the latest queries whose attention counts
    quantile: float = 0.0  # "window": count the query heads giving more than this quantile of their row instead
    schedule: str | None = None  # "pyramid": the ranked part spread over the layers
    beta: int = 1
    kernel: int = 1  # "pooled": neighbouring slots pooled, centred
    max_pool: bool = False
    gumbel: tuple | None = None  # Gumbel-regularised scores: (seed, tau_init, tau_end, tau_steps)
    merge: tuple | None = None  # evicted entries merged into the ones after them: (span, seed)
    retrieval: frozenset = frozenset()  # "head_class": the (layer, KV head) pairs ranking by score, as text ("*": any)
    score: Callable | None = None  # "own_score": the policy's own `score(entries)`

    @classmethod
    def of(cls, policy) -> Rules:
        parts = {part.name: getattr(policy, part.name) for part in type(policy).parts}
        scoring = type(policy).scoring
        accumulate = None if scoring is None else scoring.accumulate
        heads = "kv" if scoring is None else scoring.heads
        if heads not in ("kv", "layer"):  # the name of a bool setting: per KV head when it is true
            heads = "kv" if getattr(policy, heads) else "layer"
        decay = 1.0 if scoring is None else scoring.decay
        decay = float(getattr(policy, decay) if isinstance(decay, str) else decay)
        window = 0 if scoring is None else scoring.window
        window = int(getattr(policy, window) if isinstance(window, str) else window)
        quantile = 0.0 if scoring is None else scoring.quantile
        quantile = float(getattr(policy, quantile) if isinstance(quantile, str) else quantile)
        gumbel = None
        if scoring is not None and scoring.gumbel:
            gumbel = (policy.gumbel_seed, policy.tau_init, policy.tau_end, policy.tau_steps)
        return cls(
            parts,
            accumulate,
            heads == "layer",
            decay,
            type(policy).ranking.name,
            frozenset(getattr(policy, "separator_ids", ())),
            window=window,
            quantile=quantile,
            kernel=getattr(policy, "kernel", 1),
            max_pool=getattr(policy, "max_pool", False),
            schedule=type(policy).layer_schedule,
            beta=getattr(policy, "beta", 1),
            gumbel=gumbel,
            merge=(policy.merge_span, policy.merge_seed) if type(policy).eviction == "merge" else None,
            retrieval=frozenset(
                tuple(pair.split("."))
                for pair in getattr(policy, "retrieval_heads", "none").split(",")
                if pair != "none"
            ),
            score=getattr(policy, "score", None),
        )

    def layer_parts(self, layers: int) -> list[dict[str, int]]:
        """Each layer's parts: the declared ones everywhere, or (pyramid) the one ranked part running in equal
        steps from 2 * ranked - ranked // beta in the lowest layer down to ranked // beta in the highest, rounded to
        whole slots with the same total (the largest remainders one more, ties to the lower layer)."""
        if self.schedule is None or layers == 1:
            return [dict(self.parts) for _ in range(layers)]
        (name,) = [n for n in self.parts if n not in ("sinks", "recent")]
        ranked = self.parts[name]
        low, high = ranked // self.beta, 2 * ranked - ranked // self.beta
        exact = [high - (high - low) * layer / (layers - 1) for layer in range(layers)]
        slots = [math.floor(x) for x in exact]
        order = sorted(range(layers), key=lambda layer: (-(exact[layer] - slots[layer]), layer))
        for layer in order[: layers * ranked - sum(slots)]:
            slots[layer] += 1
        return [{**self.parts, name: value} for value in slots]


class Oracle:
    #: the rankings whose cut rules `cut` spells out (the engine tests compare these)
    RANKINGS = ("age", "score", "mean", "key_diversity", "token_class", "pooled", "head_class", "own_score")

    def __init__(self, model, rules: Rules, *, rolling: bool = True):
        config = model.config
        assert config.rope_parameters["rope_type"] == "default"
        assert rules.ranking in self.RANKINGS, f"no cut rules for {rules.ranking!r} here: spell them out in `cut`"
        self.model = model
        self.rules = rules
        self.parts = rules.layer_parts(config.num_hidden_layers)  # per layer
        self.rolling = rolling
        self.head_dim = config.hidden_size // config.num_attention_heads
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.entries = [[[] for _ in range(config.num_key_value_heads)] for _ in range(config.num_hidden_layers)]
        self.t = 0
        self.received: dict[int, float] | None = None  # inside a fair chunk: id(entry) -> attention received so far
        AttentionInterface.register(_ORACLE_NAME, _oracle_attention)

    @classmethod
    def for_policy(cls, model, policy, *, rolling: bool = True) -> Oracle:
        """The oracle for an engine policy object: its declaration and every field (parts, settings, separator
        ids)."""
        return cls(model, Rules.of(policy), rolling=rolling)

    def step(self, token: int) -> torch.Tensor:
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(_ORACLE_NAME)
        _running.append(self)
        self.token = token
        try:
            ids = torch.tensor([[token]])
            logits = self.model(ids, position_ids=torch.zeros_like(ids), use_cache=False).logits[0, -1]
        finally:
            _running.pop()
            self.model.set_attn_implementation(previous)
        self.t += 1
        return logits

    def chunk(self, tokens: list[int]) -> torch.Tensor:
        """Fair chunked mode as docs/design.md states it, for a policy without a band; (C, vocab) logits.

        First every head is cut to budget + 1 - C entries with the policy's rule at that smaller budget: every part
        but the sinks gives up its share of the C - 1 slots in proportion to its size (the largest remainders one
        more, ties to the part declared first), the sinks only if nothing else is left. Then the C
        tokens run one by one with no cut in between (each query sees everything before it), each query one step of
        the policy's score rule ("latest": the chunk's last query alone, as the official TOVA code does for a
        prompt); then the cut to the budget.
        """
        assert self.rules.parts and not (self.rules.ranking == "age" and self.rules.accumulate is None)
        for layer, heads in enumerate(self.entries):
            smaller = self.reduced(self.parts[layer], sum(self.parts[layer].values()) + 1 - len(tokens))
            for h in range(len(heads)):
                heads[h] = self.cut(heads[h], smaller, layer, h)
        self.received = {}
        try:
            logits = torch.stack([self.step(token) for token in tokens])
        finally:
            received, self.received = self.received, None
        for layer, heads in enumerate(self.entries):
            for h in range(len(heads)):
                for e in heads[h]:
                    if id(e) in received:
                        self.take_score(e, received[id(e)])
                heads[h] = self.cut(heads[h], self.parts[layer], layer, h)
        return logits

    @staticmethod
    def reduced(parts: dict[str, int], kept: int) -> dict[str, int]:
        """`parts` cut down to `kept` slots: every part but the sinks gives up its share of the cut in proportion to
        its size (the largest remainders one slot more, ties to the part declared first), the sinks only if nothing
        else is left."""
        parts = dict(parts)
        cut = sum(parts.values()) - kept
        declared = list(parts)  # declaration order
        others = [n for n in declared if n != "sinks" and parts[n]]
        total = sum(parts[n] for n in others)
        if cut >= total:
            for n in others:
                parts[n] = 0
            parts["sinks"] -= cut - total
            return parts
        shares = {n: cut * parts[n] / total for n in others}
        order = sorted(others, key=lambda n: (-(shares[n] - math.floor(shares[n])), declared.index(n)))
        extra = cut - sum(math.floor(share) for share in shares.values())
        for i, n in enumerate(order):
            parts[n] -= math.floor(shares[n]) + (1 if i < extra else 0)
        return parts

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return [e.position for e in self.entries[layer][head]]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """query (q_heads, dim), key/value (kv_heads, dim), all un-rotated; returns (q_heads, dim)."""
        heads = self.entries[layer]
        for h, entries in enumerate(heads):
            entries.append(Entry(self.t, key[h].double(), value[h].double(), self.token))
        outputs, probs_of = [], []
        for q_head in range(query.shape[0]):
            entries = heads[q_head // self.group]
            n = len(entries) - 1  # the new token's slot
            q_pos = n if self.rolling else self.t
            q = rope(query[q_head].double(), q_pos, self.inv_freq)
            logits = []
            for slot, e in enumerate(entries):
                k = rope(e.key, slot if self.rolling else e.position, self.inv_freq)
                logits.append(float(q @ k) * scaling)
            probs = softmax(logits)
            out = torch.zeros(value.shape[-1], dtype=torch.float64)
            for p, e in zip(probs, entries, strict=True):
                out += p * e.value
            outputs.append(out)
            if self.rules.gumbel is None:
                probs_of.append(probs)
            else:  # Keyformer: the scores see softmax((logit + Gumbel draw) / temperature), the output does not
                seed, tau_init, tau_end, tau_steps = self.rules.gumbel
                tau = tau_init + (tau_end - tau_init) * min(self.t, tau_steps) / tau_steps
                probs_of.append(
                    softmax(
                        [
                            (x + gumbel_draw(seed, layer, q_head, self.t, e.position)) / tau
                            for x, e in zip(logits, entries, strict=True)
                        ]
                    )
                )
        self.score(heads, probs_of)
        if self.received is None:  # exact mode: cut after every step (a fair chunk cuts at its end)
            for h in range(len(heads)):
                heads[h] = self.cut(heads[h], self.parts[layer], layer, h)
        return torch.stack(outputs)

    def score(self, heads: list[list[Entry]], probs_of: list[list[float]]) -> None:
        """Turn this step's probabilities (per query head, per slot) into the entries' scores."""
        if self.rules.accumulate is None:
            return
        if self.rules.quantile:  # Scissorhands: 1 where a query head gave more than its row's quantile, else 0
            probs_of = [
                [float(p > sorted(row)[min(math.floor(self.rules.quantile * len(row)), len(row) - 1)]) for p in row]
                for row in probs_of
            ]
        for h, entries in enumerate(heads):
            for slot, e in enumerate(entries):
                # what KV head h's entry received: its query heads summed, or the mean over every query head
                if self.rules.layer_mean:
                    assert all(other[slot].position == e.position for other in heads)  # one decision per layer
                    received = sum(probs[slot] for probs in probs_of) / len(probs_of)
                else:
                    received = sum(probs_of[q][slot] for q in range(h * self.group, (h + 1) * self.group))
                if self.received is None or self.rules.accumulate != "latest":
                    self.take_score(e, received)  # every query of a chunk is one step of the score rule
                else:
                    self.received[id(e)] = received  # "latest": the chunk's last query counts alone

    def take_score(self, e: Entry, received: float) -> None:
        """One step of the policy's score rule."""
        accumulate = self.rules.accumulate
        if accumulate == "latest":
            e.score = received  # only the current query's attention
        elif accumulate == "decay":
            e.score = self.rules.decay * e.score + received
        elif accumulate == "moments":
            e.score += received
            e.square += received * received
        elif accumulate == "window":  # what the latest `window` queries (steps) gave, each step one
            e.history.append((self.t, received))
            e.score = sum(given for step, given in e.history if step > self.t - self.rules.window)
        else:
            e.score += received

    def cut(self, entries: list[Entry], parts: dict[str, int], layer: int, head: int) -> list[Entry]:
        """What `parts` keep of `entries` (one layer's KV head), the evicted merged first for a policy that merges."""
        kept = self.choose(entries, parts, layer, head)
        if self.rules.merge is not None and len(kept) < len(entries):
            self.merge(entries, kept, layer, head)
        return kept

    def merge(self, entries: list[Entry], kept: list[Entry], layer: int, head: int) -> None:
        """cam: every evicted entry, oldest first, whose coin falls below min(1, its score / the mean score of the
        entries after it) adds its value / span to each of the `span` entries after it (evicted ones included)."""
        span, seed = self.rules.merge
        for i, e in enumerate(entries):
            if any(e is k for k in kept):
                continue
            after = entries[i + 1 :]
            mean = sum(o.score for o in after) / len(after) if after else 0.0
            chance = (0.0 if e.score == 0 else 1.0) if mean == 0 else min(1.0, e.score / mean)
            if entry_uniform(seed, layer, head, e.position) < chance:
                for o in after[:span]:
                    o.value = o.value + e.value / span

    def own_scores(self, entries: list[Entry], layer: int, head: int) -> dict[int, float]:
        """{stream position: the policy's `score`} of a head's `entries` (keys as the engine stores them)."""
        from h2o_stream.engine.policies import Entries

        assert self.rules.score is not None
        rows = head + 1
        keys = [e.key if self.rolling else rope(e.key, e.position, self.inv_freq) for e in entries]
        view = Entries(
            positions=torch.tensor([e.position for e in entries]).expand(1, rows, -1),
            keys=torch.stack(keys).float().expand(1, rows, -1, -1),
            values=torch.stack([e.value for e in entries]).float().expand(1, rows, -1, -1),
            scores=None
            if self.rules.accumulate is None
            else torch.tensor([e.score for e in entries]).expand(1, rows, -1),
            layer=layer,
        )
        return {e.position: float(x) for e, x in zip(entries, self.rules.score(view)[0, head], strict=True)}

    def choose(self, entries: list[Entry], parts: dict[str, int], layer: int, head: int) -> list[Entry]:
        budget = sum(parts.values())
        if not parts or len(entries) <= budget:
            return entries
        sinks_part, recent_part = parts.get("sinks", 0), parts.get("recent", 0)
        ranked = budget - sinks_part - recent_part
        split = len(entries) - recent_part
        recent = entries[split:]
        sinks = [e for e in entries[:split] if e.position < sinks_part]
        others = [e for e in entries[:split] if e.position >= sinks_part]
        ranking = self.rules.ranking
        if ranking == "age":
            return sinks + recent
        if ranking == "head_class":  # a retrieval head ranks by score (below), a streaming one keeps its newest
            classed = {(str(layer), str(head)), ("*", str(head))} & self.rules.retrieval
            ranking = "score" if classed else "newest"
        if ranking == "newest":
            chosen = others[len(others) - ranked :] if ranked else []
        elif ranking == "score":
            # the `ranked` highest scores among the others, ties to the older one; kept in stream order
            chosen = sorted(others, key=lambda e: (-e.score, e.position))[:ranked]
        elif ranking == "mean":
            # RoCo: per entry, the mean and variance of its attention over its steps in the cache (age: since it
            # arrived, counted up to the newest entry); the `volatile` of highest variance, then the highest means
            # among the rest; ties to the older one
            newest = entries[-1].position
            mean = {id(e): e.score / (newest - e.position + 1) for e in others}
            variance = {id(e): e.square / (newest - e.position + 1) - mean[id(e)] ** 2 for e in others}
            volatile = sorted(others, key=lambda e: (-variance[id(e)], e.position))[: parts.get("volatile", 0)]
            steady = [e for e in others if all(e is not v for v in volatile)]
            chosen = volatile + sorted(steady, key=lambda e: (-mean[id(e)], e.position))[: ranked - len(volatile)]
        elif ranking == "pooled":
            # SnapKV: each entry's score pooled with its neighbours among the others (slot order), `kernel` wide and
            # centred; the average counts missing neighbours as 0, the maximum ignores them
            half = self.rules.kernel // 2
            pooled = {}
            for i, e in enumerate(others):
                near = [o.score for o in others[max(0, i - half) : i + half + 1]]
                pooled[id(e)] = max(near) if self.rules.max_pool else sum(near) / self.rules.kernel
            chosen = sorted(others, key=lambda e: (-pooled[id(e)], e.position))[:ranked]
        elif ranking == "own_score":
            # the policy's own score of every entry held, asked as the engine asks it (all KV heads of the layer at
            # once: this head's entries in every head's row); the highest among the others, ties to the older one
            own = self.own_scores(entries, layer, head)
            chosen = sorted(others, key=lambda e: (-own[e.position], e.position))[:ranked]
        elif ranking == "token_class":
            # the most recent separators; spare slots to the most recent other entries
            chosen = sorted(others, key=lambda e: (e.token in self.rules.separator_ids, e.position), reverse=True)
            chosen = chosen[:ranked]
        else:  # key_diversity: the keys least similar to the mean unit key of everything held, ties to the older one
            keys = [e.key if self.rolling else rope(e.key, e.position, self.inv_freq) for e in entries]
            anchor = sum(k / k.norm() for k in keys) / len(keys)
            similarity = {
                e.position: float(k @ anchor / (k.norm() * anchor.norm())) for e, k in zip(entries, keys, strict=True)
            }
            chosen = sorted(others, key=lambda e: (similarity[e.position], e.position))[:ranked]
        return sinks + sorted(chosen, key=lambda e: e.position) + recent


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    weights = [math.exp(x - top) for x in logits]
    total = sum(weights)
    return [w / total for w in weights]


def _hash32(x: int) -> int:
    """docs/design.md's 32-bit hash: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x2c1b3c6d; x ^= x >> 16,
    products modulo 2**32."""
    x ^= x >> 16
    x = x * 0x7FEB352D % 2**32
    x ^= x >> 15
    x = x * 0x2C1B3C6D % 2**32
    return x ^ (x >> 16)


def gumbel_hash(seed: int, layer: int, q_head: int, query: int, key: int) -> int:
    """h = H(H(H(H(H(seed) ^ layer) ^ q_head) ^ H(key + s)) ^ H(query + s)), s = 0x1e3779b1 (docs/design.md)."""
    salt = 0x1E3779B1
    start = _hash32(_hash32(_hash32(seed) ^ layer) ^ q_head)
    return _hash32(_hash32(start ^ _hash32((key + salt) % 2**32)) ^ _hash32((query + salt) % 2**32))


def entry_uniform(seed: int, layer: int, kv_head: int, position: int) -> float:
    """cam's coin for an entry: u = (H(H(H(H(seed) ^ layer) ^ kv_head) ^ H(position + s)) // 2**9 + 1/2) / 2**23."""
    start = _hash32(_hash32(_hash32(seed) ^ layer) ^ kv_head)
    return ((_hash32(start ^ _hash32((position + 0x1E3779B1) % 2**32)) >> 9) + 0.5) / 2**23


def gumbel_draw(seed: int, layer: int, q_head: int, query: int, key: int) -> float:
    """The design's Gumbel draw of (layer, query head, query, key), by stream indices: -log(-log(u)),
    u = (h // 2**9 + 1/2) / 2**23 with h their `gumbel_hash`."""
    h = gumbel_hash(seed, layer, q_head, query, key)
    return -math.log(-math.log(((h >> 9) + 0.5) / 2**23))


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    oracle = _running[-1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = oracle.attend(module.layer_idx, query[0, :, -1], key[0, :, -1], value[0, :, -1], scaling)
    return out.to(query.dtype)[None, None], None
