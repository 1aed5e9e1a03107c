"""Endless chat with a fixed-size cache: the session (session.py), its chat formats (formats.py), its session file
(session_file.py) and what it reports (stats.py). Replies are decoded by `h2o_stream.generation`; `Sampling` is
re-exported from there. The names are imported on first use (`h2o_stream.lazy`); the defaults (defaults.py) load
without torch, for the command line's help."""

from h2o_stream.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        "h2o_stream.generation": ("Sampling",),
        ".defaults": ("CHAT_SAMPLING", "DEFAULT_CACHE_SIZE", "DEFAULT_CHUNK_SIZE"),
        ".formats": ("ChatFormat", "PlainFormat", "TemplateFormat", "chat_format"),
        ".session": ("ChatSession", "chat_sampling"),
        ".stats": ("TurnResult", "format_stats", "loaded_summary", "rss_bytes"),
    },
)
