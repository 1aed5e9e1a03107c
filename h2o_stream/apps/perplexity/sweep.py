"""A sweep: one resumable perplexity run per policy × cache size over a corpus, each with a checkpoint and a result file.

Files in the output directory: `<run>.ckpt` (for resuming), `<run>.json` (the result), `ppl.png` and `summary.json`.
A result is `PerplexityResult.to_json()` plus `requested_tokens`, `corpus_exhausted` (the corpus ended first),
`versions` (h2o_stream, torch, transformers, python, threads) and `command`.
"""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from h2o_stream.engine.policies import EvictionPolicy, make_policy, policy_class
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import write_json
from h2o_stream.loading.corpus import book_token_ids, describe_source, iter_books
from h2o_stream.version import __version__
from .report import plot_curves
from .run import PerplexityRun, skip_tokens_of


def run_specs(policies: list[str], sizes: list[int], parts: dict[str, int]) -> list[tuple[str, EvictionPolicy]]:
    """(run name, policy) for every policy × cache size, e.g. ('h2o-256', ...); a policy without budget parts (full)
    runs once, named by itself. Each policy gets those of `parts` it declares; the others fill in its defaults."""
    specs = []
    for name in dict.fromkeys(policies):
        takes = policy_class(name).part_names()
        if not takes:
            specs.append((name, make_policy(name)))
            continue
        given = {k: v for k, v in parts.items() if v is not None and k in takes}
        for size in dict.fromkeys(sizes):
            specs.append((f"{name}-{size}", make_policy(name, size, **given)))
    return specs


@dataclass
class Sweep:
    """The runs of one `h2o-stream ppl` call and the settings they share."""

    specs: list[tuple[str, EvictionPolicy]]
    out: Path
    data: str | None  # a corpus source as loading.corpus reads it
    tokens: int  # stream tokens per run
    chunk_size: int = 256
    rolling: bool = True
    reset_per_book: bool = False
    skip_tokens: int = 0
    checkpoint_every: int = 50_000
    curve_every: int = 1000
    resume: bool = False
    command: str = ""  # recorded in every result

    def check(self) -> None:
        """Fail before the model is loaded: results in `out` without `resume`, or a corpus without books."""
        if self.tokens < 1:
            raise H2OStreamError(f"--tokens must be at least 1, got {self.tokens}")
        out = Path(self.out)
        existing = sorted(out.glob("*.ckpt")) + sorted(out.glob("*.json")) if out.exists() else []
        if existing and not self.resume:
            raise H2OStreamError(f"{out} already holds results ({existing[0].name}, ...); pass --resume to continue "
                                 "those runs or choose another --out")
        if next(iter_books(self.data), None) is None:
            raise H2OStreamError(f"{describe_source(self.data)} holds no books")

    def run(self, model, tokenizer, model_name: str, note: Callable[[str], None] = lambda text: None) -> list[dict]:
        """Every run in turn (resumed from its checkpoint with `resume`); writes the files and returns the results.
        `note` receives one line per event worth telling a user (a run starts, resumes, runs out of corpus)."""
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        base = {"model": model_name, "data": describe_source(self.data), "skip_tokens": self.skip_tokens}
        results = []
        for name, policy in self.specs:
            note(f"== {name}: {policy.describe()}, chunk {self.chunk_size}, "
                 f"{'rolling' if self.rolling else 'no rolling'}")
            run = PerplexityRun(model, policy, chunk_size=self.chunk_size, rolling=self.rolling,
                                curve_every=self.curve_every, reset_per_book=self.reset_per_book, settings=base)
            checkpoint_path = out / f"{name}.ckpt"
            if self.resume and checkpoint_path.exists():
                run.load(checkpoint_path)
                note(f"   resumed at token {run.position:,}")
            pieces = ((i, torch.tensor(book_token_ids(b, tokenizer))) for i, b in enumerate(iter_books(self.data)))
            execute(run, skip_tokens_of(pieces, self.skip_tokens), self.tokens, checkpoint_path,
                    self.checkpoint_every)
            result = result_record(run, self.tokens, self.command)
            if result["corpus_exhausted"]:
                note(f"   the corpus has only {run.position:,} tokens after --skip-tokens; evaluated those")
            write_json(out / f"{name}.json", result)
            results.append(result)
        plot_curves(results, out / "ppl.png", f"{model_name} · {base['data']}")
        write_json(out / "summary.json", [{k: v for k, v in r.items() if k != "curve"} for r in results])
        return results


def execute(run: PerplexityRun, pieces, tokens: int, checkpoint_path: Path, checkpoint_every: int) -> None:
    """Feed `run` up to `tokens` stream tokens with a progress bar, checkpointing every `checkpoint_every` tokens and
    at the end, so that a resumed or extended run equals an uninterrupted one."""
    last_checkpoint = run.position
    bar = tqdm(total=tokens, initial=min(run.position, tokens), unit="tok", unit_scale=True, dynamic_ncols=True,
               disable=None)

    def progress(r: PerplexityRun, fed: int) -> None:
        bar.update(fed)
        if r.predicted:
            bar.set_postfix(ppl=f"{r.running_ppl:.2f}", refresh=False)

    def checkpoint(r: PerplexityRun) -> None:
        nonlocal last_checkpoint
        if r.position - last_checkpoint >= checkpoint_every:
            r.save(checkpoint_path)
            last_checkpoint = r.position

    cut_short = False

    def save_before_cut(r: PerplexityRun) -> None:
        # The last chunk is cut short by --tokens: checkpoint before it, so that a later --resume with more --tokens
        # feeds it whole and equals an uninterrupted run.
        nonlocal cut_short
        r.save(checkpoint_path)
        cut_short = True

    try:
        run.run(pieces, limit=tokens, on_progress=progress, checkpoint=checkpoint, before_cut_short=save_before_cut)
    finally:
        bar.close()
    if not cut_short:
        run.save(checkpoint_path)


def result_record(run: PerplexityRun, requested_tokens: int, command: str) -> dict:
    """The result file's content for `run` (see the module docstring for the schema)."""
    result = run.result().to_json()
    result["requested_tokens"] = requested_tokens
    result["corpus_exhausted"] = run.position < requested_tokens
    result["versions"] = versions()
    result["command"] = command
    return result


def versions() -> dict:
    """The versions a result was made with, and torch's thread count (it changes speed, not results)."""
    return {"h2o_stream": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "threads": torch.get_num_threads()}
