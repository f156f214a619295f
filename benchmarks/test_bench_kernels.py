"""pytest-benchmark suite: each kernel op, reference against Triton, at one decode layer's shape.

Run: ``pytest benchmarks/ --benchmark-group-by=param:op`` (on a GPU: Qwen3-8B layer shape at
128K tokens, budget 2048; on a CPU: a small shape, reference only, to check the suite runs).
Ratios between backends are read from one run's table; ``kvpolicy bench`` splits a whole step.
"""

from __future__ import annotations

import pytest
import torch

from kvpolicy.kernels import dispatch

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# (batch, kv heads, group, context, head_dim, budget, clusters)
SHAPE = (4, 8, 4, 131072, 128, 2048, 8192) if CUDA else (1, 2, 4, 2048, 64, 256, 128)
BACKENDS = ["reference", "triton"] if CUDA else ["reference"]
DTYPE = torch.bfloat16 if CUDA else torch.float32


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _run(benchmark, fn):
    def call():
        fn()
        _sync()

    benchmark.pedantic(call, rounds=20, warmup_rounds=3)


@pytest.fixture(scope="module")
def layer():
    torch.manual_seed(0)
    b, h, g, n, d, r, c = SHAPE
    pool = torch.randn(b, h, n, d, dtype=DTYPE)
    return {
        "query": torch.randn(b, h * g, d, dtype=DTYPE, device=DEVICE),
        "pool_cpu": pool.pin_memory() if CUDA else pool,
        "pool_gpu": pool.to(DEVICE),
        "slots": torch.randint(0, n, (b, h, r), device=DEVICE),
        "scores": torch.randn(b, h, c, device=DEVICE),
        "sizes": torch.full((b, h, c), n // c, device=DEVICE),
        "starts": torch.arange(0, n, n // c, device=DEVICE).expand(b, h, c).contiguous(),
        "order": torch.randperm(n, device=DEVICE).expand(b, h, n).contiguous(),
    }


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["select_budget"])
def test_select_budget(benchmark, layer, backend, op):
    fill = dispatch.get(op, backend, DEVICE)
    r = SHAPE[5]
    _run(benchmark, lambda: fill(layer["scores"], layer["sizes"], layer["starts"], layer["order"], r))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pool", ["pool_cpu", "pool_gpu"] if CUDA else ["pool_cpu"])
@pytest.mark.parametrize("op", ["gather_rows_into"])
def test_gather(benchmark, layer, backend, pool, op):
    gather = dispatch.get(op, backend, DEVICE)
    b, h, _, _, d, r, _ = SHAPE
    out = torch.empty(b, h, r, d, dtype=DTYPE, device=DEVICE)
    take = torch.ones(b, dtype=torch.bool, device=DEVICE)
    _run(benchmark, lambda: gather(layer[pool], layer["slots"], take, out))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["sparse_decode_attention"])
def test_attention(benchmark, layer, backend, op):
    attention = dispatch.get(op, backend, DEVICE)
    b, h, _, _, d, r, _ = SHAPE
    kv = layer["pool_gpu"][:, :, : r + 68]
    parts = [(kv[:, :, :4], kv[:, :, :4], torch.ones(b, 4, dtype=torch.bool, device=DEVICE)),
             (kv[:, :, 4 : r + 4], kv[:, :, 4 : r + 4], torch.ones(b, h, r, dtype=torch.bool, device=DEVICE)),
             (kv[:, :, r + 4 :], kv[:, :, r + 4 :], torch.ones(b, 64, dtype=torch.bool, device=DEVICE))]
    _run(benchmark, lambda: attention(layer["query"], parts, d**-0.5))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["full_attention"])
def test_full_attention(benchmark, layer, backend, op):
    """Dense decode over the whole context on the GPU: what retrieval has to beat."""
    b, h, _, n, d, _, _ = SHAPE
    kv = layer["pool_gpu"]
    if backend == "reference":
        q = layer["query"].unsqueeze(2)
        _run(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, kv, kv, enable_gqa=True))
    else:
        attention = dispatch.get("sparse_decode_attention", backend, DEVICE)
        valid = torch.ones(b, n, dtype=torch.bool, device=DEVICE)
        _run(benchmark, lambda: attention(layer["query"], [(kv, kv, valid)], d**-0.5))
