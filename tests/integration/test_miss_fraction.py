"""The miss fraction (``RunStats.miss_fraction``): of the rows the re-selections filled, the share the
retrieved buffer did not hold already. On the known-pages layer of ``test_score_gap``: a query that
stays on one page re-selects the same two pages (nothing read after the first selection); one that
alternates between two pages swaps one page of the two at each re-selection (half the rows read)."""

from __future__ import annotations

import pytest

from kvpolicy.integrations.transformers import _miss_fractions

from triggers.test_score_gap import PAGE, _layer, _step, _toward


@pytest.mark.parametrize("pages, warm", [((2,), 0.0), ((2, 3), 0.5)])
def test_miss_fraction_counts_the_rows_the_buffer_did_not_hold(pages, warm):
    state = _layer({"name": "every_step"})
    steps = 6
    for step in range(steps):
        _step(state, _toward(pages[step % len(pages)]))
    got = _miss_fractions([state])
    rows = state.store.retrieval_capacity
    assert rows == 2 * PAGE and int(state.reselections[0]) == steps
    assert got["miss_fraction_warm"] == pytest.approx(warm)
    # the first selection reads all its rows
    assert got["miss_fraction"] == pytest.approx((1 + warm * (steps - 1)) / steps)
