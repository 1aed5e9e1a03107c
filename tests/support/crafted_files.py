"""Files that run code if unpickled unsafely (a `__reduce__` payload), bare or framed as a verified file with a
correct header and digest: what every file the tool reads back must refuse."""

from __future__ import annotations

import hashlib
import io
import json

import torch

from h2o_stream.files import MAGIC

#: the kind of the verified files these tests write
KIND = "test file"


class RunsCode:
    """Unpickled without weights_only, this runs code: it writes a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def crafted_body(marker) -> bytes:
    """What torch.save writes for a checkpoint-like dict that carries code."""
    buffer = io.BytesIO()
    torch.save({"settings": {}, "position": RunsCode(marker)}, buffer)
    return buffer.getvalue()


def with_header(body: bytes, kind: str = KIND, version: int = 1) -> bytes:
    """`body` framed as a verified file with a correct header and digest: the digest does not make it trusted."""
    header = {"kind": kind, "version": version, "bytes": len(body), "sha256": hashlib.sha256(body).hexdigest()}
    return MAGIC + json.dumps(header).encode() + b"\n" + body
