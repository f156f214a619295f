"""Bit-level helpers for tests of kernels that copy rows (a copy must keep every bit)."""

from __future__ import annotations

import torch

BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def random_pool(shape, dtype, device, generator, pin=False):
    """Random bit patterns, infs and subnormals included.

    NaNs are zeroed: the reference's CPU gather rewrites half-precision NaN payloads.
    """
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, shape, dtype=bits, device=generator.device, generator=generator)
    raw.masked_fill_(raw.view(dtype).isnan(), 0)
    pool = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin)
    pool.view(bits).copy_(raw)
    return pool


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    return torch.equal(a.view(BITS[a.dtype]).cpu(), b.view(BITS[b.dtype]).cpu())
