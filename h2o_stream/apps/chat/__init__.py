"""Endless chat with a fixed-size cache: the session (library) and its session file."""

from .session import ChatSession, Sampling, TurnResult

__all__ = ["ChatSession", "Sampling", "TurnResult"]
