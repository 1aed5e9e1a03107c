"""The one exception type users see: a message that says what was wrong and what to do instead."""


class H2OStreamError(Exception):
    """A bad input or an unusable environment. The CLI prints the message alone and exits non-zero."""


def one_line(exc: BaseException, limit: int = 240) -> str:
    """Another library's exception message on one line, for quoting inside ours; some run to a page."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def option_name(argument: str) -> str:
    """A library argument or setting as a command's option names it: max_new_tokens -> --max-new-tokens (how a
    command line's checks say which of its options is wrong)."""
    return "--" + argument.replace("_", "-")
