"""``Policy`` is a pure spec: ``kvpolicy/policy.py`` imports no part of the runtime (kernels,
stores, layers, the transformers integration) when it is imported. Components reach it through
the registry, and ``apply`` imports the integration only when a policy is applied."""

from __future__ import annotations

import ast
from pathlib import Path

import kvpolicy
from kvpolicy.units.analytic_index import AnalyticIndex
from kvpolicy.units.table import UnitTable

SPEC_MODULES = {"kvpolicy.choices", "kvpolicy.errors", "kvpolicy.registry"}


def _module_level_imports(path: Path) -> set[str]:
    """Modules a file imports when it is imported (not under TYPE_CHECKING, not in a function)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = "kvpolicy" if node.level == 1 else ""
            found.add(".".join(p for p in (base, node.module or "") if p))
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_policy_module_imports_only_the_spec_side():
    imports = _module_level_imports(Path(kvpolicy.__file__).parent / "policy.py")
    runtime = {m for m in imports if m.startswith("kvpolicy") and m not in SPEC_MODULES} | (imports & {"torch"})
    assert not runtime, f"policy.py imports the runtime at import time: {sorted(runtime)}"


def test_the_import_checker_sees_a_runtime_import(tmp_path):
    # the check above must be able to fail: a file importing the store is caught
    bad = tmp_path / "policy.py"
    bad.write_text("from __future__ import annotations\nfrom .store import TieredStore\nimport torch\n")
    assert {"kvpolicy.store", "torch"} <= _module_level_imports(bad)


def test_index_types_are_classes_not_strings():
    assert kvpolicy.registry.lookup("units", "kmeans").index_type() is UnitTable
    assert kvpolicy.registry.lookup("units", "analytic").index_type() is AnalyticIndex
    assert kvpolicy.registry.lookup("selector", "top_budget").reads is UnitTable
    assert kvpolicy.registry.lookup("selector", "collision_rerank").reads is AnalyticIndex
    for preset in ("louiskv", "quest", "pariskv"):
        policy = kvpolicy.preset(preset)
        assert issubclass(policy.prefill_units.index_type(), policy.selector.reads)
