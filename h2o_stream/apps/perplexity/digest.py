"""A fingerprint of the token stream a run has fed: what binds a checkpoint to its corpus.

The digest covers every fed token together with the index of the book it belongs to (so moved book boundaries count,
which matter with --reset-per-book), in blocks of a fixed number of tokens: it does not depend on how the stream was cut
into chunks, and its state (a chained hash of the full blocks plus the unfinished block) is plain data that fits in a
checkpoint. On --resume the corpus is read up to the checkpoint's position anyway (to skip what was fed), so checking
the digest costs no extra reading, however large the corpus, and it catches another corpus under the same name, a file
edited in place, another tokenizer and moved book boundaries alike.
"""

from __future__ import annotations

import hashlib

import torch

BLOCK = 4096  # tokens per chained block: bounds the unfinished block kept in a checkpoint (64 KiB)


class StreamDigest:
    """sha256 over (book index, token id) pairs of a stream, updated as tokens are fed."""

    def __init__(self, state: dict | None = None):
        self.chain = bytes(32)
        self.tail = torch.empty((0, 2), dtype=torch.long)
        self.count = 0
        if state is not None:
            self.chain, self.tail, self.count = (
                bytes.fromhex(state["chain"]),
                state["tail"].long().cpu(),
                state["count"],
            )

    def update(self, book: int, ids: torch.Tensor) -> None:
        """Add the tokens `ids` (1-D) of book `book`."""
        ids = ids.reshape(-1).long().cpu()
        pairs = torch.stack([torch.full_like(ids, book), ids], dim=1)
        self.tail = torch.cat([self.tail, pairs])
        self.count += ids.numel()
        while len(self.tail) >= BLOCK:
            self.chain = hashlib.sha256(self.chain + _bytes(self.tail[:BLOCK])).digest()
            self.tail = self.tail[BLOCK:].clone()

    def hexdigest(self) -> str:
        """The digest of everything added so far."""
        return hashlib.sha256(self.chain + _bytes(self.tail) + self.count.to_bytes(8, "little")).hexdigest()

    def state(self) -> dict:
        """Plain data to store in a checkpoint; `StreamDigest(state)` continues from it."""
        return {"chain": self.chain.hex(), "tail": self.tail.clone(), "count": self.count}


def _bytes(pairs: torch.Tensor) -> bytes:
    return pairs.numpy().astype("<i8").tobytes()
