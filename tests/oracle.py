"""A slow, obviously-correct reference for DESIGN.md's exact mode. Tests only.

It runs the model's own layers one token at a time with every position id set to 0, so the model's rotation is the
identity and the attention function receives un-rotated queries and keys. Everything the design specifies is then
done here, plainly: per layer and per KV head a Python list of entries (stream position, key, value, score); each step
the new entry is appended, keys are rotated to their slot and the query to the new slot (plain RoPE, float64), the
softmax probabilities are added to the scores as Python floats, and the cut follows the rules word for word.
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
    score: float = 0.0


def rope(x: torch.Tensor, position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    angle = position * inv_freq
    cos, sin = torch.cos(angle), torch.sin(angle)
    half = x.shape[0] // 2
    x1, x2 = x[:half], x[half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin])


class Oracle:
    #: the policies whose cut rules `cut` spells out (the engine tests compare these)
    POLICIES = ("full", "window", "sink", "h2o")

    def __init__(self, model, policy_name: str, *, sinks: int = 0, heavy: int = 0, recent: int = 0,
                 rolling: bool = True):
        config = model.config
        assert config.rope_parameters["rope_type"] == "default"
        self.model = model
        self.policy_name, self.sinks, self.heavy, self.recent = policy_name, sinks, heavy, recent
        self.rolling = rolling
        self.head_dim = config.hidden_size // config.num_attention_heads
        theta = config.rope_parameters["rope_theta"]
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2, dtype=torch.float64) / self.head_dim)
        self.group = config.num_attention_heads // config.num_key_value_heads
        self.entries = [[[] for _ in range(config.num_key_value_heads)] for _ in range(config.num_hidden_layers)]
        self.t = 0
        AttentionInterface.register(_ORACLE_NAME, _oracle_attention)

    def step(self, token: int) -> torch.Tensor:
        previous = self.model.config._attn_implementation
        self.model.set_attn_implementation(_ORACLE_NAME)
        _running.append(self)
        try:
            ids = torch.tensor([[token]])
            logits = self.model(ids, position_ids=torch.zeros_like(ids), use_cache=False).logits[0, -1]
        finally:
            _running.pop()
            self.model.set_attn_implementation(previous)
        self.t += 1
        return logits

    def kept_positions(self, layer: int, head: int) -> list[int]:
        return [e.position for e in self.entries[layer][head]]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float):
        """query (q_heads, dim), key/value (kv_heads, dim), all un-rotated; returns (q_heads, dim)."""
        heads = self.entries[layer]
        for h, entries in enumerate(heads):
            entries.append(Entry(self.t, key[h].double(), value[h].double()))
        outputs = []
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
                e.score += p
            outputs.append(out)
        for h in range(len(heads)):
            heads[h] = self.cut(heads[h])
        return torch.stack(outputs)

    def cut(self, entries: list[Entry]) -> list[Entry]:
        budget = {"full": None, "window": self.recent, "sink": self.sinks + self.recent,
                  "h2o": self.heavy + self.recent}[self.policy_name]
        if budget is None or len(entries) <= budget:
            return entries
        split = len(entries) - self.recent
        recent = entries[split:]
        if self.policy_name == "window":
            return recent
        if self.policy_name == "sink":
            return [e for e in entries[:split] if e.position < self.sinks] + recent
        # h2o: the `heavy` highest scores among the non-recent entries, ties to the older one; kept in stream order
        heavy = sorted(entries[:split], key=lambda e: (-e.score, e.position))[: self.heavy]
        return sorted(heavy, key=lambda e: e.position) + recent


def _oracle_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    oracle = _running[-1]
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = oracle.attend(module.layer_idx, query[0, :, -1], key[0, :, -1], value[0, :, -1], scaling)
    return out.to(query.dtype)[None, None], None
