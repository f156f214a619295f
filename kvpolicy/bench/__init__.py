"""Benchmarks behind ``kvpolicy bench`` (and the pytest-benchmark suites in ``benchmarks/``)."""

# the token budget of a benchmark's policies: DESIGN.md's 2K for long contexts
BUDGET = 2048
# LouisKV's re-selection share, measured on SmolLM2 at 4K with budget 512 (EVAL.md): random weights
# have no query dynamics, so its trigger runs as interval(round(1 / rate))
LOUISKV_RATE = 0.117
