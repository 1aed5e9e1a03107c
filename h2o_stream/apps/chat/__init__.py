"""Endless chat with a fixed-size cache: the session (session.py), its chat formats (formats.py), its session file
(session_file.py) and what it reports (stats.py). Replies are decoded by `h2o_stream.generation`; `Sampling` is
re-exported from there."""

from h2o_stream.generation import Sampling

from .formats import ChatFormat, PlainFormat, TemplateFormat, chat_format
from .session import CHAT_SAMPLING, DEFAULT_CACHE_SIZE, DEFAULT_CHUNK_SIZE, ChatSession, chat_sampling
from .stats import TurnResult, format_stats, loaded_summary, rss_bytes

__all__ = ["CHAT_SAMPLING", "DEFAULT_CACHE_SIZE", "DEFAULT_CHUNK_SIZE", "ChatFormat", "ChatSession", "PlainFormat",
           "Sampling", "TemplateFormat", "TurnResult", "chat_format", "chat_sampling", "format_stats",
           "loaded_summary", "rss_bytes"]
