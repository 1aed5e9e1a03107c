"""The API keys a server accepts, and the owner each key's conversations are kept under.

An owner is named after its key (the first 16 hex digits of its sha256), so the state directory never holds a key
and a key's conversations are its own again after a restart. Without keys there is one owner, "".
"""

from __future__ import annotations

import hashlib
import hmac

from .protocol import ApiError


def owner_name(key: str) -> str:
    """The owner of the conversations of requests that carry `key`."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class Keys:
    """The keys a server accepts (none: every request is let in, as owner "")."""

    def __init__(self, keys: tuple[str, ...] | list[str] = ()):
        self._keys = [(key.encode(), owner_name(key)) for key in dict.fromkeys(k for k in keys if k)]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def owner(self, authorization: str | None) -> str:
        """The owner of a request whose Authorization header is `authorization`; ApiError 401 if it carries no key
        the server accepts. Every key is compared, in constant time, whichever matches."""
        if not self._keys:
            return ""
        scheme, _, given = (authorization or "").partition(" ")
        candidate = given.strip().encode()
        owner: str | None = None
        for key, name in self._keys:
            if hmac.compare_digest(candidate, key) and scheme.lower() == "bearer":
                owner = name
        if owner is None:
            raise ApiError(
                401,
                "a valid API key is needed (Authorization: Bearer KEY)"
                if authorization
                else "this server needs an API key (Authorization: Bearer KEY)",
                code="invalid_api_key",
            )
        return owner
