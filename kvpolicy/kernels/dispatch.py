"""Kernel dispatch: one name per op, one implementation per backend.

``backend="reference"`` is the pure-PyTorch path, always available. Fast backends
(``triton``; CUDA where Triton cannot) register implementations with ``implement`` and a
capability check; ``backend="auto"`` takes the fastest that supports the call and logs the
choice once. Asking explicitly for a backend that cannot serve is an error, never a
silent fallback.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from ..choices import BACKENDS
from ..errors import BackendUnavailableError, ConfigError
from . import reference, reference_analytic, reference_step

log = logging.getLogger("kvpolicy")

OPS = (
    "kmeans", "unit_scores", "select_budget", "gather_rows", "gather_rows_into", "resident_rows", "refresh_rows",
    "cache_insert", "write_row",
    "sparse_decode_attention", "collision_count", "candidate_topk", "rerank", "append_to_unit", "admit_row",
    "append_token", "note_decision", "query_cosine_fire", "interval_fire", "interval_decision", "commit_selection", "append_leaving_by_rule",
    "fetch_whole", "query_votes", "collision_candidates", "rerank_select", "analytic_append", "score_gap_fire",
    "score_gap_outlier_fire", "score_gap_selected", "number_misses", "unit_stats", "analytic_encode",
)
# ParisKV's ops and the decode step's bookkeeping have their reference in their own files
_REFERENCE_MODULE = {
    "collision_count": reference_analytic, "candidate_topk": reference_analytic, "rerank": reference_analytic,
    "query_votes": reference_analytic, "collision_candidates": reference_analytic, "rerank_select": reference_analytic,
    "analytic_append": reference_analytic, "analytic_encode": reference_analytic,
    **{op: reference_step for op in ("append_token", "note_decision", "query_cosine_fire", "interval_fire", "interval_decision",
                                     "commit_selection", "append_leaving_by_rule", "fetch_whole",
                                     "score_gap_fire", "score_gap_outlier_fire", "score_gap_selected")},
}
# auto tries these in order
_PREFERENCE = ("triton", "reference")


@dataclass(frozen=True)
class Implementation:
    fn: Callable
    supports: Callable[[torch.device], bool]


_IMPLEMENTATIONS: dict[str, dict[str, Implementation]] = {
    "reference": {
        op: Implementation(getattr(_REFERENCE_MODULE.get(op, reference), op), lambda device: True) for op in OPS
    },
    "triton": {},
}
_logged: set[tuple[str, str, str]] = set()


def implement(backend: str, op: str, supports: Callable[[torch.device], bool]) -> Callable[[Callable], Callable]:
    """Decorator a fast backend uses to provide ``op``."""
    if backend not in _IMPLEMENTATIONS or op not in OPS:
        raise ConfigError(f"unknown backend {backend!r} or op {op!r}; backends: {BACKENDS[1:]}, ops: {OPS}")

    def decorate(fn: Callable) -> Callable:
        _IMPLEMENTATIONS[backend][op] = Implementation(fn, supports)
        return fn

    return decorate


def triton_runs_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


_triton_loaded = False


def _load_triton() -> None:
    """Import the Triton ops on first use (importing triton costs about a second)."""
    global _triton_loaded
    if not _triton_loaded:
        _triton_loaded = True
        from . import triton as triton_ops

        triton_ops.load()


def _auto_may_use(backend: str, device: torch.device) -> bool:
    # the Triton interpreter on CPU is a test harness, far slower than the reference
    return backend != "triton" or device.type == "cuda"


def why_unavailable(backend: str, op: str, device: torch.device) -> str | None:
    """None if ``backend`` can run ``op`` on ``device``, else the reason."""
    if backend not in _IMPLEMENTATIONS:
        return f"unknown kernel backend {backend!r}; accepted: {', '.join(BACKENDS)}"
    if backend == "triton":
        if not triton_runs_on(device):
            # checked before importing the kernels: Triton decides interpreted or compiled when
            # a kernel is defined, so importing them where they cannot run would fix that choice
            return (f"kernel backend 'triton' cannot run {op!r} on {device.type} "
                    "(Triton needs a CUDA device, or TRITON_INTERPRET=1 on CPU)")
        _load_triton()
    impl = _IMPLEMENTATIONS[backend].get(op)
    if impl is None:
        have = ", ".join(sorted(_IMPLEMENTATIONS[backend])) or "no ops yet"
        return f"kernel backend {backend!r} does not implement {op!r} (it has: {have})"
    if not impl.supports(device):
        hint = " (Triton needs a CUDA device, or TRITON_INTERPRET=1 on CPU)" if backend == "triton" else ""
        return f"kernel backend {backend!r} cannot run {op!r} on {device.type}{hint}"
    return None


def check(backend: str, device: torch.device, ops: tuple[str, ...] = OPS) -> None:
    """Validate a backend choice up front (when the policy is applied)."""
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kernel backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if backend == "auto":
        return
    for op in ops:
        reason = why_unavailable(backend, op, device)
        if reason is not None:
            raise BackendUnavailableError(reason)


def get(op: str, backend: str, device: torch.device) -> Callable:
    """The implementation of ``op`` for ``backend`` on ``device`` (a bound ``Ops`` table works too)."""
    if isinstance(backend, Ops):
        return getattr(backend, op)
    if backend == "auto":
        for candidate in _PREFERENCE:
            if _auto_may_use(candidate, device) and why_unavailable(candidate, op, device) is None:
                key = (op, candidate, device.type)
                if key not in _logged:
                    _logged.add(key)
                    log.info("kvpolicy: %s runs on the %s backend (%s)", op, candidate, device.type)
                return _IMPLEMENTATIONS[candidate][op].fn
        raise BackendUnavailableError(f"no kernel backend can run {op!r} on {device.type}")
    reason = why_unavailable(backend, op, device)
    if reason is not None:
        raise BackendUnavailableError(reason)
    return _IMPLEMENTATIONS[backend][op].fn


class Ops:
    """The kernel ops of one backend on one device, resolved once (``bind``): the decode step
    calls ``ops.write_row(...)`` and never looks an op up by name or backend string."""

    def __init__(self, backend: str, device: torch.device):
        check(backend, device)
        self.backend, self.device = backend, device
        for op in OPS:
            setattr(self, op, get(op, backend, device))

    def __repr__(self) -> str:
        return f"Ops(backend={self.backend!r}, device={str(self.device)!r})"


_BOUND: dict[tuple[str, torch.device], Ops] = {}


def bind(backend: str, device: torch.device) -> Ops:
    """The ops table for ``backend`` on ``device`` (made once per pair; errors as ``check``)."""
    device = torch.device(device)
    key = (backend, device)
    if key not in _BOUND:
        _BOUND[key] = Ops(backend, device)
    return _BOUND[key]


def as_ops(ops_or_backend: "Ops | str | None", device: torch.device) -> Ops:
    """``ops_or_backend`` if it is an ops table, else ``bind(ops_or_backend, device)`` (for
    callers outside the decode step, tests and benchmarks, that name a backend); None binds the
    reference (the default of the structures' ``ops=None`` arguments)."""
    if isinstance(ops_or_backend, Ops):
        return ops_or_backend
    return bind("reference" if ops_or_backend is None else ops_or_backend, device)
