"""The tests' policy matrix, read from the registry: a new policy file is picked up by every test that can take it.

ALL: every registered policy. EVICTING: those with budget parts (a bounded cache). BANDED: evicting policies with a
band (chunked mode equals exact mode). SCORED: evicting policies that decide from attention scores.
"""

from __future__ import annotations

from h2o_stream.engine.policies import POLICIES, make_policy

ALL = list(POLICIES)
EVICTING = [name for name in ALL if POLICIES[name].parts]
BANDED = [name for name in EVICTING if make_policy(name, 24).band() is not None]
SCORED = [name for name in EVICTING if POLICIES[name].needs_scores]
