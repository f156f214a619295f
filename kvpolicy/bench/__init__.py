"""The benchmarks that ship with kvpolicy, behind ``kvpolicy bench``: measurements (``layer``,
``gather``, ``ttft``, ``e2e``, ``capacity``) and their grids as rows (``sweeps``).

Not to be confused with ``benchmarks/`` at the repository root: pytest-benchmark suites and one-off
scripts that are not installed and that use this package.
"""

# the token budget of a benchmark's policies: DESIGN.md's 2K for long contexts
BUDGET = 2048
# LouisKV's re-selection share with the preset's mean-key trigger (score_gap, mass -2.5), measured on
# SmolLM2's 4K needles with budget 512 (EVAL.md, "The rates for the decode-step issue"; 8K: 20.7%,
# the README demo: 28.2%): random weights have no query dynamics, so its trigger runs as
# interval(n), the n whose share is at least this (sweeps.louiskv_interval). Kept since SmolLM2's
# default became the outlier trigger at margin -0.5 (session 21: 22.2% on 32 4K needle samples), so
# the timed rows stay comparable with earlier sessions'
LOUISKV_RATE = 0.176
