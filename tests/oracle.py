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
from dataclasses import dataclass

import torch
from transformers import AttentionInterface

_ORACLE_NAME = "h2o_stream_test_oracle"
_running: list["Oracle"] = []


@dataclass
class Entry:
    position: int
    key: torch.Tensor  # un-rotated, float64
    value: torch.Tensor
    token: int = -1
    score: float = 0.0
    square: float = 0.0  # roco: the sum of the squares of what each step gave


def stream_for(policy, length: int, *, seed: int, vocab: int) -> torch.Tensor:
    """(1, length) random token ids for comparing `policy` with the oracle.

    For a policy that ranks keys (keydiff) the tokens are distinct: with rolling, two copies of a token have the
    same un-rotated first-layer key, an exact tie that the engine's stored keys (rotated by the model, un-rotated
    again) break by rounding noise. Which copy survives then changes no output, but the kept positions would not
    be comparable.
    """
    generator = torch.Generator().manual_seed(seed)
    if policy.needs_keys:
        assert length <= vocab - 2
        return (torch.randperm(vocab - 2, generator=generator)[:length] + 2).unsqueeze(0)
    return torch.randint(2, vocab, (1, length), generator=generator)


def run_against_oracle(spec, kv_heads: int, rolling: bool, *, steps: int):
    """Feed one random stream of `steps` tokens, token by token, through the engine and the oracle on a tiny llama
    with `kv_heads` KV heads; assert equal logits (1e-4) and kept entries of every layer and head at every step, and
    that something was evicted. Returns the engine's cache."""
    from tiny_models import VOCAB, tiny_model

    from h2o_stream import StreamingCache

    model = tiny_model("llama", num_key_value_heads=kv_heads, init_std=0.2)
    oracle = Oracle.for_policy(model, spec, rolling=rolling)
    cache = StreamingCache(model, spec, rolling=rolling)
    ids = stream_for(spec, steps, seed=kv_heads, vocab=VOCAB)
    for t in range(ids.shape[1]):
        engine_logits = model(ids[:, t:t + 1], cache=cache).logits[0, -1]
        oracle_logits = oracle.step(int(ids[0, t]))
        assert torch.allclose(engine_logits, oracle_logits, atol=1e-4, rtol=0), f"step {t}"
        for layer_idx, layer in enumerate(cache.layers):
            for head in range(kv_heads):
                assert layer.positions[0, head].tolist() == oracle.kept_positions(layer_idx, head), (t, layer_idx)
    assert cache.evicted > 0
    return cache


def rope(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    angle = position * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


class Oracle:
    #: the policies whose cut rules `cut` spells out (the engine tests compare these)
    POLICIES = ("full", "window", "sink", "h2o", "h2o_sinks", "a2sf", "tova", "sepllm", "keydiff", "roco")

    def __init__(self, model, policy_name: str, *, sinks: int = 0, heavy: int = 0, recent: int = 0,
                 states: int = 0, separators: int = 0, diverse: int = 0, volatile: int = 0, alpha: float = 1.0,
                 per_head: bool = False, separator_ids=(), rolling: bool = True):
        config = model.config
        assert config.rope_parameters["rope_type"] == "default"
        assert policy_name in self.POLICIES, f"no cut rules for {policy_name!r} here: spell them out in `cut`"
        self.model = model
        self.policy_name, self.sinks, self.heavy, self.recent = policy_name, sinks, heavy, recent
        self.states, self.separators, self.diverse, self.volatile = states, separators, diverse, volatile
        self.alpha, self.per_head, self.separator_ids = alpha, per_head, set(separator_ids)
        self.budget = None if policy_name == "full" else sinks + heavy + recent + states + separators + diverse \
            + volatile
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
    def for_policy(cls, model, policy, *, rolling: bool = True) -> "Oracle":
        """The oracle for an engine policy object: its name and every field (parts, settings, separator ids)."""
        return cls(model, policy.name, rolling=rolling, **vars(policy))

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

    BANDS = ("full", "window", "sink")  # chunked mode equals exact mode for these: no fair cut
    #: the order in which the engine's policies declare their parts (ties in a fair chunk's cut go to the earlier)
    PART_ORDER = ("sinks", "volatile", "heavy", "states", "separators", "diverse", "recent")

    def chunk(self, tokens: list[int]) -> torch.Tensor:
        """Fair chunked mode as docs/design.md states it, for a policy without a band; (C, vocab) logits.

        First every head is cut to budget + 1 - C entries with the policy's rule at that smaller budget: every part
        but the sinks gives up its share of the C - 1 slots in proportion to its size (the largest remainders one
        more, ties to the part declared first), the sinks only if nothing else is left. Then the C
        tokens run one by one with no cut in between (each query sees everything before it), each query one step of
        the policy's score rule (summed, or decayed then summed for a2sf; tova: the chunk's last query alone, as the
        official code does for a prompt); then the cut to the budget.
        """
        assert self.policy_name not in self.BANDS
        kept = self.budget + 1 - len(tokens)
        names = [n for n in self.PART_ORDER if getattr(self, n)]
        saved = {name: getattr(self, name) for name in (*names, "budget")}
        cut = self.budget - kept
        others = [n for n in names if n != "sinks"]
        total = sum(getattr(self, n) for n in others)
        if cut >= total:
            for n in others:
                setattr(self, n, 0)
            self.sinks -= cut - total
        else:  # each other part gives up its share of the cut; the largest remainders give one slot more
            shares = {n: cut * getattr(self, n) / total for n in others}
            order = sorted(others, key=lambda n: (-(shares[n] - math.floor(shares[n])), self.PART_ORDER.index(n)))
            extra = cut - sum(math.floor(share) for share in shares.values())
            for i, n in enumerate(order):
                setattr(self, n, getattr(self, n) - math.floor(shares[n]) - (1 if i < extra else 0))
        self.budget = kept
        for heads in self.entries:
            for h in range(len(heads)):
                heads[h] = self.cut(heads[h])
        for name, value in saved.items():
            setattr(self, name, value)
        self.received = {}
        try:
            logits = torch.stack([self.step(token) for token in tokens])
        finally:
            received, self.received = self.received, None
        for heads in self.entries:
            for h in range(len(heads)):
                for e in heads[h]:
                    if id(e) in received:
                        self.take_score(e, received[id(e)])
                heads[h] = self.cut(heads[h])
        return logits

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
            top = max(logits)
            weights = [math.exp(x - top) for x in logits]
            total = sum(weights)
            probs = [w / total for w in weights]
            out = torch.zeros(value.shape[-1], dtype=torch.float64)
            for p, e in zip(probs, entries):
                out += p * e.value
            outputs.append(out)
            probs_of.append(probs)
        self.score(heads, probs_of)
        if self.received is None:  # exact mode: cut after every step (a fair chunk cuts at its end)
            for h in range(len(heads)):
                heads[h] = self.cut(heads[h])
        return torch.stack(outputs)

    def score(self, heads: list[list[Entry]], probs_of: list[list[float]]) -> None:
        """Turn this step's probabilities (per query head, per slot) into the entries' scores."""
        for h, entries in enumerate(heads):
            for slot, e in enumerate(entries):
                # what KV head h's entry received: its query heads summed, or the mean over every query head
                if self.policy_name == "tova" and not self.per_head:
                    assert all(other[slot].position == e.position for other in heads)  # one decision per layer
                    received = sum(probs[slot] for probs in probs_of) / len(probs_of)
                else:
                    received = sum(probs_of[q][slot] for q in range(h * self.group, (h + 1) * self.group))
                if self.received is None or self.policy_name != "tova":
                    self.take_score(e, received)  # every query of a chunk is one step of the score rule
                else:
                    self.received[id(e)] = received  # tova: the chunk's last query counts alone

    def take_score(self, e: Entry, received: float) -> None:
        """One step of the policy's score rule."""
        if self.policy_name == "tova":
            e.score = received  # only the current query's attention
        elif self.policy_name == "a2sf":
            e.score = self.alpha * e.score + received
        elif self.policy_name == "roco":
            e.score += received
            e.square += received * received
        else:
            e.score += received

    def cut(self, entries: list[Entry]) -> list[Entry]:
        if self.budget is None or len(entries) <= self.budget:
            return entries
        if self.policy_name == "tova":  # drop the lowest score (ties: the newer entry goes); no window, no sinks
            kept = sorted(entries, key=lambda e: (-e.score, e.position))[: self.budget]
            return sorted(kept, key=lambda e: e.position)
        split = len(entries) - self.recent
        recent = entries[split:]
        sinks = [e for e in entries[:split] if e.position < self.sinks]
        others = [e for e in entries[:split] if e.position >= self.sinks]
        if self.policy_name == "window":
            return recent
        if self.policy_name == "sink":
            return sinks + recent
        if self.policy_name in ("h2o", "h2o_sinks", "a2sf"):
            # the `heavy` highest scores among the others, ties to the older one; kept in stream order
            chosen = sorted(others, key=lambda e: (-e.score, e.position))[: self.heavy]
        elif self.policy_name == "roco":
            # RoCo: per entry, the mean and variance of its attention over its steps in the cache (age: since it
            # arrived, counted up to the newest entry); the `volatile` of highest variance, then the `heavy` of
            # highest mean among the rest; ties to the older one
            newest = entries[-1].position
            mean = {id(e): e.score / (newest - e.position + 1) for e in others}
            variance = {id(e): e.square / (newest - e.position + 1) - mean[id(e)] ** 2 for e in others}
            volatile = sorted(others, key=lambda e: (-variance[id(e)], e.position))[: self.volatile]
            steady = [e for e in others if all(e is not v for v in volatile)]
            chosen = volatile + sorted(steady, key=lambda e: (-mean[id(e)], e.position))[: self.heavy]
        elif self.policy_name == "sepllm":
            # the most recent separators; spare slots to the most recent other entries
            chosen = sorted(others, key=lambda e: (e.token in self.separator_ids, e.position), reverse=True)
            chosen = chosen[: self.separators]
        else:  # keydiff: the keys least similar to the mean unit key of everything held, ties to the older one
            keys = [e.key if self.rolling else rope(e.key, e.position, self.inv_freq) for e in entries]
            anchor = sum(k / k.norm() for k in keys) / len(keys)
            similarity = {e.position: float(k @ anchor / (k.norm() * anchor.norm())) for e, k in zip(entries, keys)}
            chosen = sorted(others, key=lambda e: (similarity[e.position], e.position))[: self.diverse]
        return sinks + sorted(chosen, key=lambda e: e.position) + recent


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    oracle = _running[-1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = oracle.attend(module.layer_idx, query[0, :, -1], key[0, :, -1], value[0, :, -1], scaling)
    return out.to(query.dtype)[None, None], None
