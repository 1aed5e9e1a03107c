"""`h2o-stream serve`: endless conversations behind an OpenAI-compatible API, each in fixed memory, none lost.

Each conversation is a `h2o_stream.apps.chat.ChatSession` (its own StreamingCache); the server recognises a
conversation by the history the client resends (conversations.py), keeps at most N sessions in memory and every
completed turn on disk as a verified chat session file (store.py), and runs all turns on one model worker thread,
interleaved token by token (worker.py). protocol.py and history.py read OpenAI's request format, service.py ties
the parts together, app.py is the HTTP layer (FastAPI; `pip install "h2o-stream[serve]"`). docs/serve.md says how a
client sees it.
"""

from h2o_stream.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".limits": ("DEFAULT_IN_MEMORY", "DEFAULT_MAX_BATCH", "Limits"),
        ".protocol": ("ApiError",),
        ".service": ("ServeSettings", "Service", "api_key_from_env"),
    },
)
