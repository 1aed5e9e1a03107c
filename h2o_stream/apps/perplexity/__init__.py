"""Streaming perplexity: the resumable run, sweeps over policies and cache sizes, and their result files.

run.py (the run and its verified checkpoints), stream.py (the token stream: its pieces, its cuts into forwards,
per-token NLL), digest.py (the fed-token digest that binds a checkpoint to its corpus), binding.py (every run checked
against model, data, settings and its files before the first starts), sweep.py (the runs of one call), launch.py (a
sweep launched: checked, --out locked, the model loaded, its runs run here, in workers.py's processes or as
ray_runs.py's tasks), execution.py (feeding runs with checkpoint pacing, their result records), outdir.py (--out checked
writable and locked), interrupt.py (SIGINT/SIGTERM: checkpoint and stop), report.py (plot and table over every run in
--out). Failure behaviours: docs/failures.md.
The names below are imported on first use (`h2o_stream.lazy`).
"""

from h2o_stream.lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    __name__,
    {
        ".run": ("PerplexityResult", "PerplexityRun", "stream_perplexity"),
        ".stream": ("skip_tokens_of",),
    },
)
