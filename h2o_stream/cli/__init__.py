"""The `h2o-stream` command line: one click group; each command lives in its own module, named in COMMANDS.

Commands are thin: they parse options, call the library (h2o_stream.apps) and print. Every H2OStreamError becomes one
`Error: ...` line on stderr and exit status 2. A command's module is imported only when the command is asked for (or
listed by the group's --help), and imports torch, transformers and the applications inside the command's body: help
and usage errors answer without loading them (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import importlib
import sys

import click

from h2o_stream.errors import H2OStreamError

#: command name -> "module:attribute" of its click command
COMMANDS = {
    "ppl": "h2o_stream.cli.ppl:ppl",
    "leaderboard": "h2o_stream.cli.leaderboard:leaderboard",
    "chat": "h2o_stream.cli.chat:chat",
    "summarize": "h2o_stream.cli.summarize:summarize",
    "serve": "h2o_stream.cli.serve:serve",
    "calibrate": "h2o_stream.cli.calibrate:calibrate",
}


class LazyGroup(click.Group):
    """A click group that imports a command's module when the command is first looked up."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in self.commands and name in COMMANDS:
            module, attribute = COMMANDS[name].split(":")
            self.add_command(getattr(importlib.import_module(module), attribute), name)
        return super().get_command(ctx, name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Each command with the first paragraph of its help in full, wrapped (click's default cuts it at about 45
        characters, mid-phrase)."""
        rows = [
            (name, command.short_help or (command.help or "").split("\n\n")[0])
            for name in self.list_commands(ctx)
            for command in [self.get_command(ctx, name)]
            if command is not None and not command.hidden
        ]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl([(name, " ".join(text.split())) for name, text in rows])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="h2o-stream")
def cli():
    """Streaming generation and perplexity with a fixed-size KV cache (H2O, StreamingLLM sinks, and newer policies)."""


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
