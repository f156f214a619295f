"""The evaluation's summary: the re-selection share as a mean of the cells' and over all their (layer, step) pairs."""

import pytest

from kvpolicy.eval.report import summarize, table
from kvpolicy.eval.runner import CellResult


def _cell(seed, share, steps, preset="louiskv"):
    return CellResult(task="niah_single", length=8192, seed=seed, preset=preset, budget=512, score=100.0,
                      prediction="", reselect_share=share, recall=1.0, recall_per_layer={}, seconds=1.0,
                      model="smollm2", decode_steps=steps)


def test_the_share_over_pairs_weighs_each_cell_by_its_steps():
    # a 4-step answer that re-selected at its first step only, and a 60-step answer at 10% of its pairs
    (row,) = summarize([_cell(0, 0.25, 4), _cell(1, 0.10, 60)])
    assert row["reselect_share"] == pytest.approx(0.175)
    assert row["reselect_share_pairs"] == pytest.approx((0.25 * 4 + 0.10 * 60) / 64)
    assert "| 17.5% | 10.9% |" in table([row])


def test_a_cell_without_recorded_steps_leaves_the_share_over_pairs_out():
    (row,) = summarize([_cell(0, 0.25, 4), _cell(1, 0.10, None)])
    assert row["reselect_share"] == pytest.approx(0.175) and row["reselect_share_pairs"] is None
    assert "| 17.5% | - |" in table([row])
    (dense,) = summarize([_cell(0, None, 5, preset="full")])
    assert dense["reselect_share"] is None and dense["reselect_share_pairs"] is None
