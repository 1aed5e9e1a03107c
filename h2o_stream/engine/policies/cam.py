"""`cam` — CaM, Cache Merging (Zhang et al., ICML 2024, "CaM: Cache Merging for Memory-efficient LLMs Inference";
official code zyxxmu/cam, `local_cam_mask` in `utils_hh/modify_llama_cam.py`), on StreamingLLM's cache.

Keep the first `sinks` stream tokens and the last `recent` entries, as `sink`; but an entry leaving the window is
merged into the entries after it instead of dropped outright: with a its attention from the latest query and m the
mean attention of the entries after it (per KV head, its query heads summed), it is merged with probability
min(1, a / m), and then its value / `merge_span` is added to each of the `merge_span` entries after it. The coin is
seeded (`merge_seed`) and a pure function of (layer, KV head, entry), so runs repeat; the official code draws it
from torch's generator (`torch.bernoulli`). Keys are never merged.

Where the official code differs: it merges each entry one step before it leaves, when it is the second-oldest of the
window, with that step's attention, and leaves the entry's own value as it is for its last step; here an entry is
merged at the cut that evicts it, with the attention of the query just made. Its window counts the newest token;
here the budget is what is held between steps and a query sees budget + 1 entries. Its default splits a prompt's
cache half start, half recent; a stream has no prompt, and the default here is the sink policy's 4 sinks with the
rest recent, so that cam at its defaults is sink plus merging. Decided per layer and KV head. In a fair chunk the
latest query is the chunk's last.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import RECENT, SINKS, EvictionPolicy, Scores, setting
from .ranking import AGE
from .registry import register


@register
@dataclass
class CaMPolicy(EvictionPolicy):
    sinks: int
    recent: int
    merge_span: int = setting(
        32,
        "entries after an evicted one that its value is spread over (CaM's 32)",
        within=(0, 1 << 20),
        called="cam's merge span",
    )
    merge_seed: int = setting(
        0, "seed of the merge coins (a run repeats with the same seed)", within=(-1, (1 << 32) - 1)
    )
    name = "cam"
    parts = (SINKS, RECENT)
    scoring = Scores("latest")
    ranking = AGE
    eviction = "merge"
