"""Long-document summarization through a fixed-size cache: single-pass and hierarchical strategies."""

from .summarize import SummaryResult, summarize

__all__ = ["SummaryResult", "summarize"]
