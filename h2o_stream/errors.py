"""The one exception type users see: a message that says what was wrong and what to do instead."""


class H2OStreamError(Exception):
    """A bad input or an unusable environment. The CLI prints the message alone and exits non-zero."""
