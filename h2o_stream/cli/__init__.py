"""The `h2o-stream` command line: one click group; each command lives in its own module and is added here.

Commands are thin: they parse options, call the library (h2o_stream.apps) and print. Every H2OStreamError becomes one
`Error: ...` line on stderr and exit status 2.
"""

from __future__ import annotations

import sys

import click

from h2o_stream.errors import H2OStreamError

from .chat import chat
from .leaderboard import leaderboard
from .ppl import ppl
from .serve import serve
from .summarize import summarize


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="h2o-stream")
def cli():
    """Streaming generation and perplexity with a fixed-size KV cache (H2O, StreamingLLM sinks, and newer policies)."""


for _command in (ppl, leaderboard, chat, summarize, serve):
    cli.add_command(_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point: every H2OStreamError becomes one line on stderr and exit status 2."""
    argv = sys.argv[1:] if argv is None else [str(arg) for arg in argv]
    try:
        # obj: the arguments as given, for commands that print or record how to run them again (ppl's --resume hint)
        status = cli.main(args=argv, standalone_mode=False, obj={"argv": argv})
    except H2OStreamError as error:
        click.echo(f"Error: {error}", err=True)
        sys.exit(2)
    except click.exceptions.Abort:
        click.echo("Aborted.", err=True)
        sys.exit(130)
    except click.ClickException as error:
        error.show()
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        click.echo("Interrupted.", err=True)
        sys.exit(130)
    if isinstance(status, int) and status:
        sys.exit(status)
