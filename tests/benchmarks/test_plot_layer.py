"""benchmarks/plot_layer.py: the ratios it plots, and a clear error for a cell without full attention."""

import pytest


@pytest.fixture(scope="module")
def plot_layer(benchmark_script):
    return benchmark_script("plot_layer")


def _row(preset, placement, batch, context, amortised, full=None):
    return {"preset": preset, "placement": placement, "batch": batch, "context": context,
            "amortised_ms": amortised, "full_sdpa_ms": full}


def test_speedup_is_full_over_amortised_of_the_same_cell(plot_layer):
    rows = [_row("louiskv", "cpu", 4, 1024, 0.5, full=2.0), _row("quest", "cpu", 4, 1024, 4.0),
            _row("louiskv", "cpu", 4, 2048, 1.0, full=3.0)]
    lines = plot_layer.speedups(rows)
    assert lines[("louiskv", "cpu", 4)] == [(1024, 4.0), (2048, 3.0)]
    assert lines[("quest", "cpu", 4)] == [(1024, 0.5)]


def test_a_cell_without_full_attention_is_named(plot_layer):
    with pytest.raises(ValueError, match="batch 1, context 64"):
        plot_layer.speedups([_row("louiskv", "cpu", 1, 64, 1.0)])
