"""Triton implementations of the kernel ops, one file per op or per family of ops (step,
refresh, score_gap).

Importing this package registers them with the dispatch. Triton kernels run on CUDA, and on
CPU under ``TRITON_INTERPRET=1`` (set before this package is imported: Triton reads it when a
kernel is decorated); the interpreter is for tests only, so ``backend="auto"`` never picks it.

Every kernel is declared ``@pdl_kernel`` over ``@triton.jit`` and waits for the kernel before it as its
first statement (``pdl.py``): on sm_90 and later a reusing step's kernels are scheduled while the one
before them finishes (programmatic dependent launch).
"""

from __future__ import annotations

import importlib

# each module registers its op with ``dispatch.implement("triton", ...)``
_MODULES = ("admit", "analytic_append", "analytic_encode", "attention", "candidates", "collision", "collision_candidates", "fetch", "gather", "kmeans", "query_votes",
            "refresh", "rerank", "rerank_select", "score_gap", "score_gap_outlier", "select", "step", "unit_append", "unit_stats", "write")


def load() -> None:
    for name in _MODULES:
        try:
            importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as error:
            # an op whose module is not written yet simply stays unimplemented
            if error.name != f"{__name__}.{name}":
                raise
