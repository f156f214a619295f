"""Benchmarks behind ``kvpolicy bench`` (and the pytest-benchmark suites in ``benchmarks/``)."""
