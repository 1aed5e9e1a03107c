"""CaM's merges compiled (policies/merging.py): the evicted entries' values spread over the entries after them, one
after another, oldest first, as docs/design.md defines the merge.

On tensors the merges are one linear map (a triangular solve for the evicted values as they stand when each merges,
then one product), a dozen small operations per layer and cut. Here one loop adds each merging entry's value, as it
stands then, / span to the `span` entries after it, in slot order. The same merges; the sums are rounded in another
order than the solve's and the product's, so the values agree with the tensor path to float rounding, not bit for bit
(tests/policies/test_cam.py). CPU only, float32 or float64 values. Numba compiles it on first use (cached on disk);
without numba, or with H2O_STREAM_COMPILED=0, the tensor path runs.
"""

from __future__ import annotations

import numba
import torch

_compile = numba.njit(cache=True, boundscheck=False, error_model="numpy")


def merge_in_order(values: torch.Tensor, order: torch.Tensor, merges: torch.Tensor, span: int) -> torch.Tensor:
    """`values` (batch, kv_heads, n, dim) after each evicted slot of `order` (batch, kv_heads, evicted; ascending)
    whose `merges` (bool, same shape) is set has added its value / `span` to each of the `span` slots after it
    (evicted ones included). A new tensor."""
    merged = values.contiguous().clone()
    out = merged.numpy()
    _merge(out, order.contiguous().numpy(), merges.contiguous().numpy(), out.dtype.type(1) / out.dtype.type(span), span)
    return merged


@_compile
def _merge(values, order, merges, weight, span):  # pragma: no cover - compiled (tests compare it with the tensors)
    batch, kv_heads, n, dim = values.shape
    for b in range(batch):
        for h in range(kv_heads):
            for k in range(order.shape[2]):
                if not merges[b, h, k]:
                    continue
                e = order[b, h, k]
                for t in range(e + 1, min(e + span, n - 1) + 1):
                    for c in range(dim):
                        values[b, h, t, c] += weight * values[b, h, e, c]
