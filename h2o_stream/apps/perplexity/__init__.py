"""Streaming perplexity: the resumable run, sweeps over policies and cache sizes, and their result files."""

from .run import PerplexityResult, PerplexityRun, skip_tokens_of, stream_perplexity

__all__ = ["PerplexityResult", "PerplexityRun", "skip_tokens_of", "stream_perplexity"]
