"""The tests' policy matrix, read from the registry: a new policy file is picked up by every test that can take it.

ALL: every registered policy that a name and a cache size build (`make_policy(name, size)`). EVICTING: those with
budget parts (a bounded cache). BANDED: evicting policies with a band (chunked mode equals exact mode). SCORED:
evicting policies that decide from attention scores. TOKENIZED: the policies that also need the model's tokenizer
(sepllm); the tests that build them pass one (tests/test_policies_*.py).
"""

from __future__ import annotations

from h2o_stream.engine.policies import POLICIES, make_policy

TOKENIZED = [name for name, cls in POLICIES.items() if cls.needs_tokenizer]
ALL = [name for name in POLICIES if name not in TOKENIZED]
EVICTING = [name for name in ALL if POLICIES[name].parts]
BANDED = [name for name in EVICTING if make_policy(name, 24).band() is not None]
SCORED = [name for name in EVICTING if POLICIES[name].needs_scores]
