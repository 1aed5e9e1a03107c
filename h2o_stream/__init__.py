"""h2o-stream: streaming, infinite-context generation with a fixed-size KV cache (H2O, StreamingLLM sinks)."""

from .attention import attach
from .cache import StreamingCache
from .errors import H2OStreamError
from .perplexity import PerplexityResult, stream_perplexity
from .policies import POLICIES, EvictionPolicy, make_policy, register
from .summarize import SummaryResult, summarize

__all__ = ["H2OStreamError", "EvictionPolicy", "POLICIES", "PerplexityResult", "StreamingCache", "attach", "make_policy",
           "register", "stream_perplexity", "SummaryResult", "summarize"]
