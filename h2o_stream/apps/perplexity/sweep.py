"""A sweep: one resumable perplexity run per policy × cache size over a corpus, each with a checkpoint and a result
file.

Files in the output directory: `<run>.ckpt` (for resuming), `<run>.json` (the result; its fields: `execution`),
`ppl.png` and `summary.json` (both over every run result in the directory, not only this call's). The runs are fed and
checkpointed by `execution.execute`.

Every run is checked before the first one starts (its policy, budget and chunk against the model, its checkpoint and
result files, the corpus against its checkpoint: `binding`), so a bad one fails before any work or any write.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from h2o_stream.engine.policies import POLICIES, EvictionPolicy, make_policy, policy_class, register
from h2o_stream.errors import H2OStreamError
from h2o_stream.files import write_json
from h2o_stream.loading.corpus import book_token_ids, books_text, corpus_directory, describe_source, iter_books

from .binding import Plan, check_stream, corpus_settings, data_path, model_fingerprint, plan
from .execution import execute, result_record, write
from .interrupt import Interrupted, StopRequest
from .progress import Progress
from .report import check_comparable, plot_curves, results_in, title_of
from .run import PerplexityRun
from .stream import forward_span, select_books, skip_tokens_of

REPORTS = ("ppl.png", "summary.json")


def run_specs(
    policies: list[str],
    sizes: list[int],
    parts: dict,
    tokenizer=None,
) -> list[tuple[str, EvictionPolicy]]:
    """(run name, policy) for every policy × cache size, e.g. ('h2o-256', ...); a policy without budget parts (full)
    runs once, named by itself. A part given as a list of several slot counts is swept: one run per value and
    size, named by it too (e.g. 'h2o-256-heavy=16'), which the reports show as 'h2o heavy=16'. Each policy gets
    those of `parts` (budget parts and settings, e.g. {'alpha': 0.9}) it declares; the others fill in its defaults.
    A part or setting that none of the policies takes is an error (it would be silently ignored).

    `tokenizer` is the model's tokenizer, which some policies need (sepllm). Without it those policies are checked
    as far as can be without building them (their name and what they take) and left out, so that a command can check
    every run before the model loads and build them all once it has."""
    policies = list(dict.fromkeys(policies))
    takes = {name: (*policy_class(name).part_names(), *policy_class(name).option_names()) for name in policies}
    for part, value in parts.items():
        if value is not None and not any(part in names for names in takes.values()):
            taken = "; ".join(
                f"{name} takes {', '.join(_flag(p) for p in names) or 'no parts'}" for name, names in takes.items()
            )
            raise H2OStreamError(
                f"{_flag(part)} does not apply to {', '.join(policies)} ({taken}); drop it or add "
                "a policy that takes it"
            )
    specs = []
    for name in policies:
        if policy_class(name).needs_tokenizer and tokenizer is None:
            continue
        given = {k: v for k, v in parts.items() if v is not None and k in takes[name]}
        # a part given as a list of several values is swept (one run each); a list of one is that value
        fixed = {
            k: (v[0] if isinstance(v, list) else v) for k, v in given.items() if not isinstance(v, list) or len(v) == 1
        }
        swept = {k: v for k, v in given.items() if isinstance(v, list) and len(v) > 1}
        if not policy_class(name).part_names():
            specs.append((name, make_policy(name, tokenizer=tokenizer, **fixed)))
            continue
        for size in dict.fromkeys(sizes):
            for values in itertools.product(*swept.values()):
                choice = dict(zip(swept, values, strict=True))
                suffix = "".join(f"-{part}={value}" for part, value in choice.items())
                specs.append(
                    (f"{name}-{size}{suffix}", make_policy(name, size, tokenizer=tokenizer, **fixed, **choice))
                )
    return specs


def _flag(name: str) -> str:
    """A part's or setting's command-line option: per_head -> --per-head."""
    return "--" + name.replace("_", "-")


@dataclass
class Sweep:
    """The runs of one `h2o-stream ppl` call and the settings they share."""

    specs: list[tuple[str, EvictionPolicy]]
    out: Path
    data: str | None  # a corpus source as loading.corpus reads it
    tokens: int  # stream tokens per run
    chunk_size: int | None = None  # None: each policy's default_chunk_size
    span: int | None = None  # tokens per forward; None: each run's default_span (speed only, results are the same)
    rolling: bool = True
    wide_chunks: bool = False
    reset_per_book: bool = False
    skip_tokens: int = 0
    books: tuple[int, ...] | None = None  # the corpus's books to read (their indices); None: every book
    book_tokens: int | None = None  # read each book's first this many tokens only; None: whole books
    checkpoint_every: int = 50_000
    curve_every: int = 1000
    resume: bool = False
    command: str = ""  # recorded in every result
    sliding: str = "window"  # what sliding-window layers keep (engine/layer_types.py)
    rows: int = 1  # runs per model forward: runs that share a span and stream position ride as rows of one batch

    def check_runs(self, model, tokenizer, model_name: str):
        """Check every run against the model, its files and the corpus (see `binding`) before any work; returns
        (a maker of each run's PerplexityRun, each run's Plan)."""
        out = Path(self.out)
        out.mkdir(parents=True, exist_ok=True)
        source = describe_source(self.data)
        base = {
            "model": model_name,
            "model_weights": model_fingerprint(model),
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": model.device.type,
            "data": source,
            **corpus_settings(self.data),
            "skip_tokens": self.skip_tokens,
            **self.selection(),
            "curve_every": self.curve_every,
        }

        def new_run(policy: EvictionPolicy) -> PerplexityRun:  # checks the budget and chunk against the model
            return PerplexityRun(
                model,
                policy,
                chunk_size=self.chunk_size,
                rolling=self.rolling,
                curve_every=self.curve_every,
                reset_per_book=self.reset_per_book,
                settings=base,
                wide_chunks=self.wide_chunks,
                span=self.span,
                sliding=self.sliding,
            )

        plans = [plan(name, new_run(policy), out, self.tokens, self.resume) for name, policy in self.specs]
        # the reports cover every result in `out`: one made on another stream or model would be ranked beside these
        check_comparable(
            results_in(out),
            out,
            {**base, "rolling": self.rolling, "reset_per_book": self.reset_per_book},
            "the runs of this command",
        )
        # without rolling, a stream longer than the model's positions fails up front (count one token past them)
        fixed_positions = not self.rolling and not self.reset_per_book
        context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 0
        # a policy without a budget (full) keeps every token, so even rolled its positions grow with the stream
        growing = next((name for name, policy in self.specs if policy.budget is None), None) if context else None
        streamed = check_stream(
            self.pieces(tokenizer),
            plans,
            tokens=self.tokens,
            reset_per_book=self.reset_per_book,
            source=source,
            skip_tokens=self.skip_tokens,
            count_to=context + 1 if fixed_positions or (growing and not self.reset_per_book) else 0,
        )
        if fixed_positions:
            new_run(self.specs[0][1]).cache.check_fits(streamed)
        if growing is not None and self.rolling:
            self._check_growing(growing, streamed, context, tokenizer)
        return new_run, plans

    def _check_growing(self, name: str, streamed: int, context: int, tokenizer) -> None:
        """Refuse a run of a policy that keeps every token (`name`, full) whose cache would outgrow the model's
        `context` positions: the whole stream of `streamed` tokens, or with --reset-per-book its longest book."""
        if not self.reset_per_book:
            if streamed > context:
                raise H2OStreamError(
                    f"--policy {name} keeps every token, so a stream of more than {context:,} tokens needs more "
                    f"positions than the model's {context:,}: use --tokens {context} or fewer, or --reset-per-book "
                    f"with --book-tokens {context} or fewer (each book then starts an empty cache)"
                )
            return
        if self.tokens <= context or (self.book_tokens is not None and self.book_tokens <= context):
            return
        fed = 0
        held: dict[int, int] = {}
        for index, ids in self.pieces(tokenizer):
            held[index] = held.get(index, 0) + min(ids.numel(), self.tokens - fed)
            fed += ids.numel()
            if held[index] > context:
                raise H2OStreamError(
                    f"--policy {name} keeps every token of a book (--reset-per-book), and book {index} has more "
                    f"than {context:,} tokens within --tokens {self.tokens:,}, more than the model's {context:,} "
                    f"positions: use --book-tokens {context} or fewer, or fewer --tokens"
                )
            if fed >= self.tokens:
                return

    def check(self) -> None:
        """Fail before the model is loaded: results or reports in `out` without `resume`, or a corpus without books."""
        if self.tokens < 2:
            raise H2OStreamError(
                f"--tokens must be at least 2 (the stream's first token is not predicted), got {self.tokens}"
            )
        for name, policy in self.specs:  # a --span that is not a multiple of a policy's own chunk size
            chunk_size, span = forward_span(policy, self.chunk_size, self.span)
            if span % chunk_size:
                raise H2OStreamError(
                    f"--span {span} is not a multiple of the chunk size of {name} ({chunk_size}); give a --span "
                    "that is, or --chunk-size"
                )
        out = Path(self.out)
        existing = (
            sorted(out.glob("*.ckpt")) + sorted(out.glob("*.json")) + [out / r for r in REPORTS] if out.is_dir() else []
        )
        existing = [path for path in existing if path.exists()]
        if existing and not self.resume:
            raise H2OStreamError(
                f"{out} already holds results ({existing[0].name}, ...); pass --resume to continue "
                "those runs or choose another --out"
            )
        corpus = corpus_directory(self.data)
        if corpus is not None and corpus in (out.resolve(), *out.resolve().parents):
            raise H2OStreamError(
                f"--out {out} is inside the corpus --data {self.data}: the results written there "
                "would be read as books of the corpus; choose an --out outside it"
            )
        if self.book_tokens is not None and self.book_tokens < 1:
            raise H2OStreamError(f"--book-tokens must be at least 1, got {self.book_tokens}")
        if self.books is not None and not self.books:
            raise H2OStreamError("--books names no book")
        books = iter_books(self.data)
        count = sum(1 for _ in books) if self.books else int(next(books, None) is not None)
        if not count:
            raise H2OStreamError(f"{describe_source(self.data)} holds no books")
        chosen = self.books or ()
        missing = [index for index in chosen if index >= count]
        if missing:
            held = f"{count} books, indices 0-{count - 1}" if count > 1 else "1 book, index 0"
            raise H2OStreamError(
                f"--books {books_text(chosen)}: {describe_source(self.data)} has no book {missing[0]} ({held})"
            )

    def selection(self) -> dict:
        """The settings of --books and --book-tokens when given (a run without them records neither, as before)."""
        chosen = {"books": None if self.books is None else books_text(self.books), "book_tokens": self.book_tokens}
        return {key: value for key, value in chosen.items() if value is not None}

    def pieces(self, tokenizer):
        """The stream as (book index, token ids) pieces: the --books chosen, each cut to --book-tokens, after
        --skip-tokens."""
        books = (
            (i, torch.tensor(book_token_ids(b, tokenizer)))
            for i, b in enumerate(iter_books(self.data))
            if self.books is None or i in self.books  # a book left out is not tokenized
        )
        return skip_tokens_of(select_books(books, self.books, self.book_tokens), self.skip_tokens)

    def groups(self) -> list[list[str]]:
        """The run names in groups that may ride as the rows of one batch: up to `rows` runs with the same span
        (tokens per forward), in order. A group whose runs turn out to be at different stream positions (resumed
        from different checkpoints) is split again when it runs."""
        if self.rows == 1:
            return [[name] for name, _ in self.specs]
        by_span: dict[int, list[str]] = {}
        for name, policy in self.specs:
            by_span.setdefault(forward_span(policy, self.chunk_size, self.span)[1], []).append(name)
        return [names[i : i + self.rows] for names in by_span.values() for i in range(0, len(names), self.rows)]

    def only(self, names: list[str]) -> Sweep:
        """This sweep with only the runs `names` (a worker's or a Ray task's share)."""
        specs = dict(self.specs)
        return dataclasses.replace(self, specs=[(name, specs[name]) for name in names])

    def run(
        self,
        model,
        tokenizer,
        model_name: str,
        note: Callable[[str], None] = lambda text: None,
        stop: StopRequest | None = None,
        bars: Progress | None = None,
        report: bool = True,
    ) -> list[dict]:
        """Every run in turn, or `rows` at a time as the rows of one batch (resumed from its checkpoint with
        `resume`); writes the files and returns the results of every run in `out`. `note` receives one line per event
        worth telling a user (a run starts, resumes, runs out of corpus). With `stop`, a requested stop checkpoints
        after the current forward and raises `Interrupted`. `bars`: where progress goes (default: bars drawn
        here). Without `report`, no reports are written (nor results returned): a worker's share leaves them to the
        parent."""
        out = Path(self.out)
        new_run, plans = self.check_runs(model, tokenizer, model_name)
        policies, starts = dict(self.specs), dict(zip((name for name, _ in self.specs), plans, strict=True))
        for group in self.groups():
            if self.resume:
                for name in [name for name in group if starts[name].done]:
                    note(f"== {name}: already done (its result file covers --tokens {self.tokens:,}); kept as it is")
                group = [name for name in group if not starts[name].done]
            by_position: dict[int, list[str]] = {}
            for name in group:
                by_position.setdefault(starts[name].position, []).append(name)
            for names in by_position.values():
                if stop is not None and stop.signum is not None:  # a stop was requested
                    raise Interrupted(stop.signum, None, None)
                runs = [self._start(name, policies[name], new_run, starts[name], note) for name in names]
                execute(
                    runs,
                    self.pieces(tokenizer),
                    self.tokens,
                    [out / f"{name}.ckpt" for name in names],
                    self.checkpoint_every,
                    stop,
                    ", ".join(names),
                    bars,
                )
                for name, run in zip(names, runs, strict=True):
                    self._finish(name, run, len(runs), note)
        return write_reports(out) if report else []

    def _start(self, name: str, policy: EvictionPolicy, new_run, start: Plan, note) -> PerplexityRun:
        run = new_run(policy)
        note(
            f"== {name}: {policy.describe()}, chunk {run.chunk_size}{' (wide)' if self.wide_chunks else ''} "
            f"in forwards of {run.span}, {'rolling' if self.rolling else 'no rolling'}"
        )
        if start.position:
            checkpoint = Path(self.out) / f"{name}.ckpt"
            run.load(checkpoint)
            # A run that --tokens ended checkpoints before its last, cut-short forward, so a longer run resumes a
            # little before where the first one stopped (2,816 of 3,000 tokens, say): say so.
            further = (
                f" (that run went on to token {start.result_tokens:,}: it checkpoints before a last forward "
                "cut short by --tokens, so that a longer run makes that forward whole)"
                if start.result_tokens > run.position
                else ""
            )
            note(
                f"   resumed at token {run.position:,}: the tokens before it were scored by an earlier run, whose "
                f"checkpoint is {checkpoint}{further}"
            )
        return run

    def _finish(self, name: str, run: PerplexityRun, rows: int, note) -> None:
        if not run.predicted:  # check_stream makes this unreachable; never write a NaN result
            raise H2OStreamError(f"{name} had nothing to predict")
        result = result_record(run, self.tokens, self.command, data_path(self.data))
        result["rows"] = rows
        result["run"] = name  # a swept part's value is in the name only (report.run_label)
        if result["corpus_exhausted"]:
            picked = self.selection()
            stream = (
                "the corpus"
                if not picked
                else "the stream of "
                + " cut to ".join(f"--{key.replace('_', '-')} {value}" for key, value in picked.items())
            )
            note(f"   {name}: {stream} has only {run.position:,} tokens after --skip-tokens; evaluated those")
        write(Path(self.out) / f"{name}.json", lambda path: write_json(path, result))


def run_share(
    sweep: Sweep,
    groups: Iterable[list[str]],
    loading: dict,
    stop: StopRequest | None = None,
    note: Callable[[str], None] = lambda text: None,
    bars: Progress | None = None,
) -> None:
    """A worker's or a Ray task's share of `sweep`: load the model once with `loading` (load_model's keyword
    arguments) and run each group of runs (`Sweep.groups`) as a sweep of its own, files and all. The parent
    already showed the model loading: here it loads without transformers' progress bar."""
    from transformers.utils import logging as transformers_logging

    from h2o_stream.loading.models import load_model

    for _, policy in sweep.specs:  # a policy registered at run time in the parent is known here by its class alone
        if type(policy).name not in POLICIES:
            register(type(policy))
    transformers_logging.disable_progress_bar()
    loaded = load_model(**loading)
    note(f"ready: torch and {loaded.name} loaded")
    for names in groups:  # the reports over every run are the parent's to write, once all have finished
        sweep.only(names).run(
            loaded.model, loaded.tokenizer, loaded.name, stop=stop, note=note, bars=bars, report=False
        )


def write_reports(out: Path) -> list[dict]:
    """ppl.png and summary.json over every run result in `out` (none while there is none); returns the results."""
    results = results_in(out)
    if not results:
        return results
    write(out / "ppl.png", lambda path: plot_curves(results, path, title_of(results)))
    write(
        out / "summary.json",
        lambda path: write_json(path, [{k: v for k, v in r.items() if k != "curve"} for r in results]),
    )
    return results
