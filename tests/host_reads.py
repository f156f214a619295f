"""``no_host_reads()``: inside it, reading a tensor's values on the host raises.

A CUDA graph replays kernels only; a value the step's Python read from a device tensor
(``.item()``, ``int(t)``, ``if t:``, ``.tolist()``, ``.cpu()``, ``.numpy()``) is frozen at capture
time, and on a GPU each such read is also a sync. On a CPU the emulated replay re-runs the
Python, so such a read gives the right value there and only this guard catches it.

Creating tensors from Python numbers, shapes and dtypes, and comparing them, stay allowed.
"""

from __future__ import annotations

import contextlib

import torch

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class HostReadError(AssertionError):
    pass


@contextlib.contextmanager
def no_host_reads(what: str = "the decode step"):
    originals = {name: getattr(torch.Tensor, name) for name in _READS}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise HostReadError(f"{what} read a tensor on the host: Tensor.{name} (shape {tuple(self.shape)})")

        return read

    for name in _READS:
        setattr(torch.Tensor, name, refuse(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
