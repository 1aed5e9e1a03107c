"""h2o-stream: streaming, infinite-context generation with a fixed-size KV cache (H2O, StreamingLLM sinks).

Layers, imports flowing one way (checked by import-linter, see pyproject.toml):
engine (cache, attention, policies, feed) <- generation (the decode loop) | loading (models, corpora)
<- apps (perplexity, chat, summarize) <- cli. This package's root re-exports the public API from all of them.
"""

from .apps.perplexity import PerplexityResult, stream_perplexity  # noqa: E402
from .apps.summarize import SummaryResult, summarize  # noqa: E402
from .engine import POLICIES, EvictionPolicy, StreamingCache, attach, make_policy, register  # noqa: E402
from .errors import H2OStreamError  # noqa: E402
from .loading.models import LoadedModel, load_model  # noqa: E402
from .version import __version__  # noqa: E402

__all__ = ["H2OStreamError", "EvictionPolicy", "LoadedModel", "POLICIES", "PerplexityResult", "StreamingCache", "attach",
           "load_model", "make_policy", "register", "stream_perplexity", "SummaryResult", "summarize", "__version__"]
