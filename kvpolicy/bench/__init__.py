"""The benchmarks that ship with kvpolicy, behind ``kvpolicy bench``: measurements (``layer``,
``gather``, ``ttft``, ``e2e``, ``capacity``) and their grids as rows (``sweeps``).

Not to be confused with ``benchmarks/`` at the repository root: pytest-benchmark suites and one-off
scripts that are not installed and that use this package.
"""

# the token budget of a benchmark's policies: DESIGN.md's 2K for long contexts
BUDGET = 2048
# LouisKV's re-selection share, measured on SmolLM2 at 4K with budget 512 (EVAL.md): random weights
# have no query dynamics, so its trigger runs as interval(round(1 / rate))
LOUISKV_RATE = 0.117
