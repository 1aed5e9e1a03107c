"""Streaming perplexity: the resumable run, sweeps over policies and cache sizes, and their result files.

run.py (the run and its verified checkpoints), digest.py (the fed-token digest that binds a checkpoint to its corpus),
binding.py (every run checked against model, data, settings and its files before the first starts), sweep.py (the
runs of one call, checkpoint pacing), outdir.py (--out checked writable and locked), interrupt.py (SIGINT/SIGTERM:
checkpoint and stop), report.py (plot and table over every run in --out). Failure behaviours: docs/failures.md.
"""

from .run import PerplexityResult, PerplexityRun, skip_tokens_of, stream_perplexity

__all__ = ["PerplexityResult", "PerplexityRun", "skip_tokens_of", "stream_perplexity"]
