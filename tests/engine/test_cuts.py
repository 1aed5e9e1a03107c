"""The cut every ranked policy makes (`slots.top_slots`, `slots.keep_top`): sinks, then the highest ranks, ties to
the older entry, then the recent window; its shortcuts (the one-entry cut, the compiled cut that drops few) keep what
the two stable sorts keep."""

from __future__ import annotations

import pytest
import torch

from h2o_stream.engine.policies.slots import keep_top, top_slots


def test_top_slots_one_entry_cut_equals_the_stable_sort():
    """The one-entry cut (exact mode's usual case) takes a shortcut; it must keep what the stable sort keeps, ties
    going to the older entry, on tie-heavy ranks."""

    def by_sort(ranks, count):
        order = torch.sort(ranks, dim=-1, descending=True, stable=True).indices
        return order[..., :count].sort(dim=-1).values

    generator = torch.Generator().manual_seed(0)
    for _ in range(300):
        m = int(torch.randint(2, 40, (1,), generator=generator))
        ranks = torch.randint(0, 4, (2, 3, m), generator=generator).double()
        assert torch.equal(top_slots(ranks, m - 1), by_sort(ranks, m - 1))
        assert torch.equal(top_slots(ranks, m - 1, start=5), by_sort(ranks, m - 1) + 5)
        assert torch.equal(top_slots(ranks, m // 2), by_sort(ranks, m // 2))


def test_keep_top_is_sinks_then_the_top_ranks_then_the_recent_window():
    """keep_top's one-entry cut returns every slot but one in a single range; it must equal the three parts
    assembled, ties going to the older entry, with and without sinks, at any cut."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(300):
        sinks, recent = (int(v) for v in torch.randint(0, 5, (2,), generator=generator))
        m = int(torch.randint(2, 30, (1,), generator=generator))
        ranks = torch.randint(0, 4, (2, 3, m), generator=generator).double()
        n = sinks + m + recent
        for count in (m - 1, m // 2):
            expected = torch.cat(
                [
                    torch.arange(sinks).expand(2, 3, sinks),
                    top_slots(ranks, count, start=sinks),
                    torch.arange(n - recent, n).expand(2, 3, recent),
                ],
                dim=-1,
            )
            assert torch.equal(keep_top(ranks, count, sinks=sinks, recent=recent), expected)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.long])
def test_keep_top_keeps_the_same_slots_compiled_as_on_tensors(dtype, monkeypatch):
    """A cut dropping few is compiled on the CPU (engine/compiled_cuts.py): the same slots as the two stable sorts,
    with many ties, infinities and NaN (above every number, as torch sorts it), for every count it takes and one
    beyond."""
    from h2o_stream.engine.compiled_cuts import FEW

    generator = torch.Generator().manual_seed(2)
    special = [float("nan"), float("inf"), -float("inf")] if dtype.is_floating_point else [-(2**62), 2**62]
    for _ in range(60):
        sinks, recent = (int(v) for v in torch.randint(0, 4, (2,), generator=generator))
        m = int(torch.randint(2, 90, (1,), generator=generator))
        ranks = torch.randint(0, 5, (2, 3, m), generator=generator).to(dtype)
        odd = torch.rand(2, 3, m, generator=generator) < 0.1
        ranks[odd] = torch.tensor(special, dtype=dtype)[torch.randint(0, len(special), (int(odd.sum()),))]
        for count in {1, m // 2, m - 2, m - FEW, m - FEW - 1} - {m - 1}:
            if count < 1:
                continue
            compiled = keep_top(ranks, count, sinks=sinks, recent=recent)
            with monkeypatch.context() as patch:
                patch.setenv("H2O_STREAM_COMPILED", "0")
                on_tensors = keep_top(ranks, count, sinks=sinks, recent=recent)
            assert torch.equal(compiled, on_tensors), (m, count)


def test_keep_top_keeps_half_precision_ranks_on_tensors():
    """Ranks numpy cannot read (bfloat16) take the two sorts: the same slots as the same ranks in float32."""
    ranks = torch.randint(0, 4, (1, 2, 30), generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    kept = keep_top(ranks, 26, sinks=2, recent=3)
    assert torch.equal(kept, keep_top(ranks.float(), 26, sinks=2, recent=3))
