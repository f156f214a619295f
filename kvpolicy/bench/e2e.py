"""End-to-end decode throughput in transformers: policies against full attention done well.

A random-weight model (Qwen3-8B's shape by default) decodes from a context of random KV laid
straight into each cache (no prefill: the decode step is what is measured). Kinds:

    full-graph    transformers' StaticCache (KV preallocated, written in place) read by kvpolicy's
                  split-K decode kernel (``static_attention``), one decode step captured as a
                  CUDA graph and replayed: full attention done well
    full-sdpa-graph   the same through transformers' SDPA (a mask over the whole cache: no flash
                  kernel, K/V repeated for GQA); for reference
    full-eager    transformers' DynamicCache (concatenation per step), eager: the plain figure
    <policy>      a kvpolicy policy through ``DecodeGraph`` (graph-replayed)

Random weights have no query dynamics, so LouisKV's cosine trigger says nothing here: the
caller replaces it by ``interval(n)`` at a re-selection rate measured on a real model, and by
``every_step`` for the worst case.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from ..graph import DecodeGraph
from ..integrations.transformers import PolicyCache, cache_argument_name
from ..policy import Policy


class DoesNotFit(torch.cuda.OutOfMemoryError):
    """A cell whose KV alone, counted from the config before anything is allocated, exceeds the
    memory it would go to (full attention at 1M tokens on one H200; pinned pools past the host's
    memory, where pinning could wake the kernel's OOM killer instead of raising). A subclass of
    ``OutOfMemoryError``: callers that skip a cell out of memory skip this one the same way."""


def _kv_shape(config, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(layers, kv_heads, head_dim, element_size)`` of ``config``'s KV (every layer counted)."""
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, dim, torch.empty((), dtype=dtype).element_size()


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def _check_fits(label: str, need: int, room: int, where: str) -> None:
    if need > room:
        raise DoesNotFit(f"does not fit: {label} needs {_gib(need)} of KV, {_gib(max(room, 0))} {where}")


def check_full_fits(model, kind: str, batch: int, context: int, steps: int) -> None:
    """Raise ``DoesNotFit`` where ``full_throughput``'s cache cannot fit: every layer's StaticCache
    (``context + steps + 4`` slots) and one layer of random KV being copied in, against the
    device's available bytes less ``bench.capacity``'s margin (``capacity.plan_full``'s count)."""
    from ..placement import device_available_bytes, device_total_bytes, pool_bytes
    from .capacity import DEVICE_MARGIN, _margin, full_slots

    device = next(model.parameters()).device
    layers, heads, dim, size = _kv_shape(model.config, model.dtype)
    need = layers * pool_bytes(batch, heads, full_slots(context, steps), dim, size) + pool_bytes(batch, heads, context, dim, size)
    room = device_available_bytes(device) - _margin(DEVICE_MARGIN, device_total_bytes(device))
    _check_fits(f"{kind} at {batch} x {context} tokens", need, room, f"available on {device} (less a margin)")


def check_policy_fits(model, policy: Policy, batch: int, context: int, steps: int) -> None:
    """Raise ``DoesNotFit`` where the policy's pools alone (every layer, ``context`` plus the
    decode's reserve) cannot fit where its placement puts them: the GPU ("gpu"), pinned host
    memory ("cpu" on a CUDA device), or both together ("split"). What else a policy holds (its
    index, buffers) is not counted: a cell that passes may still run out of GPU memory."""
    from ..placement import device_available_bytes, device_total_bytes, host_available_bytes, pool_bytes
    from .capacity import DEVICE_MARGIN, HOST_MARGIN, _margin, split_slots

    device = next(model.parameters()).device
    layers, heads, dim, size = _kv_shape(model.config, model.dtype)
    need = layers * pool_bytes(batch, heads, split_slots(context, steps), dim, size)
    device_room = device_available_bytes(device) - _margin(DEVICE_MARGIN, device_total_bytes(device))
    host_room = host_available_bytes() - _margin(HOST_MARGIN, device_total_bytes(torch.device("cpu")))
    label = f"{policy.name}/{policy.placement} at {batch} x {context} tokens"
    if policy.placement == "gpu" or device.type != "cuda":
        _check_fits(label, need, device_room, f"available on {device} (less a margin)")
    elif policy.placement == "cpu":
        _check_fits(label, need, host_room, "of host memory available to pin (less a margin)")
    else:
        _check_fits(label, need, max(device_room, 0) + max(host_room, 0), "on the GPU and the host together (less margins)")


@dataclass
class Throughput:
    kind: str
    batch: int
    context: int
    steps: int
    ms_per_step: float
    # a policy row's share of re-selected rows read from the pool (RunStats.miss_fraction_warm)
    miss_fraction: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.batch * 1e3 / self.ms_per_step


def _random_kv(config, batch: int, length: int, device, dtype, generator):
    heads = config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    shape = (batch, heads, length, dim)
    return (torch.randn(shape, generator=generator, device=device, dtype=dtype),
            torch.randn(shape, generator=generator, device=device, dtype=dtype))


def _timed(device, step, steps: int, around=None) -> float:
    """Mean wall ms of ``steps`` calls of ``step``; ``around``: a context manager entered around
    the timed loop only (a profiler, say)."""
    with around if around is not None else contextlib.nullcontext():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return 1e3 * (time.perf_counter() - started) / steps


def lay_random_context(model, cache: PolicyCache, batch: int, context: int, seed: int = 0, *,
                       one_layer_at_a_time: bool = False) -> None:
    """Random KV of ``context`` tokens straight into every layer of a policy's ``cache`` (no
    prefill: the decode step is what is measured). ``one_layer_at_a_time``: wait for each layer's
    prompt units (built on a side stream that holds its random KV until done) before the next, so
    the peak memory holds one layer's KV, not several queued ones."""
    device = next(model.parameters()).device
    config = model.config
    generator = torch.Generator(device=device).manual_seed(seed)
    valid = torch.ones(batch, context, dtype=torch.bool, device=device)
    # the prompt's last query, for a policy that selects from it (its own generator: the KV stays as it was)
    queries = torch.Generator(device=device).manual_seed(seed + 1)
    for layer in cache.layers:
        keys, values = _random_kv(config, batch, context, device, model.dtype, generator)
        layer.is_initialized, layer.device = True, device
        last_query = torch.randn(batch, config.num_attention_heads, keys.shape[-1], device=device, dtype=model.dtype,
                                 generator=queries)
        layer.state.prefill(keys, values, valid, config.num_attention_heads, last_query=last_query)
        del keys, values
        if one_layer_at_a_time and device.type == "cuda":
            layer.state.wait_for_units()
            torch.cuda.synchronize(device)


@torch.inference_mode()
def time_policy_decode(model, policy: Policy, batch: int, context: int, steps: int, *, emulate: bool = False,
                       seed: int = 0, around=None, branches: str = "auto", one_layer_at_a_time: bool = False,
                       with_stats: bool = False):
    """Mean ms of ``steps`` replayed decode steps of ``policy`` over a random ``context``, and the
    session's ``RunStats`` when ``with_stats`` (else None). ``branches``: ``DecodeGraph``'s (how a
    captured step holds the re-selection's work); ``one_layer_at_a_time``: ``lay_random_context``'s."""
    device = next(model.parameters()).device
    check_policy_fits(model, policy, batch, context, steps)
    with policy.apply(model) as session:
        cache = session.new_cache()
        if not isinstance(cache, PolicyCache):
            raise ValueError(f"policy {policy.name!r} is dense; use full_throughput")
        lay_random_context(model, cache, batch, context, seed, one_layer_at_a_time=one_layer_at_a_time)
        runner = DecodeGraph(model, cache, torch.full((batch,), context, device=device), steps + 2, emulate=emulate,
                             branches=branches)
        token = torch.zeros(batch, dtype=torch.long, device=device)
        runner.step(token)  # eager warm-up
        runner.step(token)  # capture + first replay
        ms = _timed(device, lambda: runner.step(token), steps, around)
        stats = session.stats() if with_stats else None
    session.cache = None  # the pools go with this call, not with the next cell's
    return ms, stats


def policy_throughput(model, policy: Policy, batch: int, context: int, steps: int, **options) -> Throughput:
    """``time_policy_decode`` as a row, with its miss fraction (``options``: its keywords)."""
    ms, stats = time_policy_decode(model, policy, batch, context, steps, with_stats=True, **options)
    return Throughput(policy.name, batch, context, steps, ms, stats.miss_fraction_warm)


@torch.inference_mode()
def full_throughput(model, kind: str, batch: int, context: int, steps: int, *, seed: int = 0,
                    backend: str = "triton", around=None) -> Throughput:
    """``kind``: "full-graph" / "full-sdpa-graph" (StaticCache, captured) or "full-eager" (DynamicCache)."""
    from transformers import DynamicCache, StaticCache

    from .static_attention import set_attention, use_static_full_attention

    device = next(model.parameters()).device
    config = model.config
    generator = torch.Generator(device=device).manual_seed(seed)
    if kind in ("full-graph", "full-sdpa-graph"):
        check_full_fits(model, kind, batch, context, steps)
        cache = StaticCache(config=config, max_cache_len=context + steps + 4)
    elif kind == "full-eager":
        cache = DynamicCache(config=config)
    else:
        raise ValueError(f"unknown kind {kind!r}; accepted: full-graph, full-sdpa-graph, full-eager")
    saved = config._attn_implementation
    if kind == "full-graph":
        use_static_full_attention(model, backend)
    try:
        ms = _time_full(model, cache, kind, batch, context, steps, generator, around)
    finally:
        set_attention(model, saved)
    return Throughput(kind, batch, context, steps, ms)


def _time_full(model, cache, kind: str, batch: int, context: int, steps: int, generator, around) -> float:
    device = next(model.parameters()).device
    config = model.config
    for idx in range(config.num_hidden_layers):
        keys, values = _random_kv(config, batch, context, device, model.dtype, generator)
        cache.update(keys, values, idx, {"cache_position": torch.arange(context, device=device)})
        del keys, values
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    position_ids = torch.full((batch, 1), context, dtype=torch.long, device=device)
    cache_position = torch.tensor([context], dtype=torch.long, device=device)
    arg = cache_argument_name(model)

    def forward():
        return model(input_ids=ids, position_ids=position_ids, cache_position=cache_position, use_cache=True,
                     logits_to_keep=1, **{arg: cache}).logits

    def advance():
        position_ids.add_(1)
        cache_position.add_(1)

    if kind == "full-eager" or device.type != "cuda":
        forward()
        advance()

        def step():
            forward()
            advance()
    else:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            forward()
            advance()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            forward()
        # capture wrote nothing to the cache, but StaticCache's own length counter is a
        # tensor the graph advances; positions advance outside the graph
        graph.replay()
        advance()

        def step():
            graph.replay()
            advance()

    return _timed(device, step, steps, around)
