"""h2o-stream: streaming, infinite-context generation with a fixed-size KV cache (H2O, StreamingLLM sinks).

Layers, imports flowing one way (checked by import-linter, see pyproject.toml):
engine (cache, attention, policies, feed) <- generation (the decode loop) | loading (models, corpora)
<- apps (perplexity, chat, summarize) <- cli. This package's root re-exports the public API from all of them.

The names are imported on first use (lazy.py), so `import h2o_stream` (and the command line's --help) does not load
torch until something needs it.
"""

from .errors import H2OStreamError
from .lazy import lazy_exports
from .version import __version__

__getattr__, __dir__, _lazy = lazy_exports(
    __name__,
    {
        ".apps.perplexity": ("PerplexityResult", "stream_perplexity"),
        ".apps.summarize": ("SummaryResult", "summarize"),
        ".engine.policies": ("POLICIES", "EvictionPolicy", "make_policy", "register"),
        ".engine": ("StreamingCache", "attach"),
        ".loading.models": ("LoadedModel", "load_model"),
    },
)
__all__ = ["H2OStreamError", "__version__", *_lazy]
