"""`python -m eval SUITE [PART] [options]`, from the repository's root: the benchmark suites and the renderer.

Each suite lives in its own package (eval/speed/, eval/needle/, ...), its command imported only when it runs (most
import torch and h2o-stream, which take seconds; `render` reads JSON files only); what the suites share, and the
renderer of the results page, sit at eval/'s top level. docs/benchmarks.md says what each part measures, its
command, how long it takes and where it writes.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass

import click

from eval.common import BadInput, invoked_with
from h2o_stream.errors import H2OStreamError


@dataclass(frozen=True)
class Suite:
    """A suite's click command, as "module:attribute" (imported when it runs), and its one-line summary."""

    command: str
    summary: str


#: suite name -> its command and summary (a new suite registers here)
SUITES = {
    "speed": Suite(
        "eval.speed.run:speed",
        "Ours against the raw twin in alternating rounds (parts: decode, scan, fair, rows, startup).",
    ),
    "quality": Suite(
        "eval.quality.run:quality",
        "Fair chunks vs exact mode: the perplexity gap (parts: gap, runs, equivalence).",
    ),
    "leaderboard": Suite(
        "eval.long.runs:leaderboard",
        "Every policy at cache 128, 256 and 512 over one stream (h2o-stream leaderboard).",
    ),
    "long": Suite(
        "eval.long.runs:long",
        "The long fair-chunk runs and their report (parts: fair, fair_gemma3, 4m, report).",
    ),
    "needle": Suite("eval.needle.run:needle", "Passkey retrieval through the cache, every policy."),
    "soak": Suite("eval.soak.run:soak", "Long chats and generated text (parts: chat, defaults)."),
    "device": Suite(
        "eval.device.check:main",
        "Accelerator check: correctness of every policy on the device, then timings.",
    ),
    "render": Suite(
        "eval.render:render",
        "docs/results.md and the marked blocks of README.md and docs/ from eval/results/**/*.json.",
    ),
    "serve": Suite(
        "eval.serve.run:serve",
        "h2o-stream serve under load: 16 conversations x 20 turns, TTFT, tokens/s, RSS.",
    ),
    "attention": Suite(
        "eval.attention.run:attention",
        "Attention mass on sinks, the recent window and older keys, per layer, per model.",
    ),
    "seam": Suite(
        "eval.seam.run:seam",
        "Every policy's per-token NLLs in every path, recorded and compared (parts: record, compare).",
    ),
    "split": Suite(
        "eval.split.run:split",
        "The heavy-hitter share of h2o and h2o_sinks, chosen on some books, reported on others.",
    ),
    "profile": Suite(
        "eval.speed.profile:profile",
        "Where fair chunks spend the time their raw twin does not, operator by operator (torch profiler).",
    ),
    "coverage": Suite(
        "eval.coverage.report:coverage",
        "The test suite's coverage of h2o_stream per package, from a measured run (.ci/run).",
    ),
    "calibration": Suite(
        "eval.calibration.run:calibration",
        "head_hybrid's head classifications per model and cache size (parts: run, figure).",
    ),
}


class Suites(click.Group):
    """A group whose commands are imported when they are asked for, not when the group is built."""

    def list_commands(self, ctx):
        return list(SUITES)

    def get_command(self, ctx, name):
        if name not in SUITES:
            return None
        module, attribute = SUITES[name].command.split(":")
        command = getattr(importlib.import_module(module), attribute)
        command.short_help = SUITES[name].summary
        return command

    def format_commands(self, ctx, formatter):
        """The suites' one-line summaries without importing them."""
        with formatter.section("Suites"):
            formatter.write_dl([(name, suite.summary) for name, suite in SUITES.items()])


@click.group(cls=Suites, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 120})
def cli():
    """The benchmark suites of h2o-stream and the renderer of their results."""


def main(argv: list[str] | None = None) -> None:
    """Run `python -m eval` with `argv` (default: the process's arguments)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    invoked_with(argv)
    try:
        cli.main(argv, prog_name="python -m eval")
    except H2OStreamError as error:  # a bad input the library found inside a suite (a model path, a setting)
        click.echo(f"Error: {error}", err=True)
        sys.exit(BadInput.exit_code)


if __name__ == "__main__":
    main()
