"""The rest of a kernel test's cross product, on the GPU only.

Triton's interpreter runs a kernel's programs one after another in Python, so on CI's 2-core CPU a
kernel test's every combination of options costs minutes. Such a test runs a covering subset on the
CPU (every option value, and each pair of options the kernel branches on together) and the whole
cross product where a GPU makes it cheap: mark the other combinations ``GPU_CROSS``, or build the
parameter list with ``cross``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import pytest
import torch

GPU_CROSS = pytest.mark.skipif(not torch.cuda.is_available(),
                               reason="the rest of the cross product runs on the GPU; the interpreter runs a "
                                      "covering subset")


def cross(first: Sequence | Mapping, second: Sequence | Mapping, on_cpu: Iterable[tuple[int, int]]) -> list:
    """Every pair ``(a, b)`` of ``first`` x ``second`` (each a tuple of parameters, or one value),
    flattened into one parameter tuple; the pairs whose indices are not in ``on_cpu`` are marked
    ``GPU_CROSS``. ``on_cpu`` must use every case of both lists at least once. A mapping names its
    cases (``{name: case}``, indexed in order): a pair's test id is then ``name-other``, the other
    list's case by its name or its value."""
    names = [[str(name) for name in cases] if isinstance(cases, Mapping) else None for cases in (first, second)]
    first, second = (list(cases.values()) if isinstance(cases, Mapping) else cases for cases in (first, second))
    on_cpu = set(on_cpu)
    used_first = {i for i, _ in on_cpu}
    used_second = {j for _, j in on_cpu}
    if used_first != set(range(len(first))) or used_second != set(range(len(second))):
        raise ValueError(f"cross: on_cpu must use every case of both lists; first uses {sorted(used_first)} of "
                         f"{len(first)}, second {sorted(used_second)} of {len(second)}")
    params = []
    for (i, a), (j, b) in itertools.product(enumerate(first), enumerate(second)):
        values = (a if isinstance(a, tuple) else (a,)) + (b if isinstance(b, tuple) else (b,))
        named = None
        if names[0] or names[1]:
            named = f"{names[0][i] if names[0] else a}-{names[1][j] if names[1] else b}"
        params.append(pytest.param(*values, marks=() if (i, j) in on_cpu else GPU_CROSS, id=named))
    return params
