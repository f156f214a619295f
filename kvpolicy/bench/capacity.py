"""Capacity: decode tokens/s at a long context for the largest batch each side can hold.

    full-graph      the largest batch whose full KV (transformers' StaticCache, read by the split-K
                    kernel, the step replayed as a CUDA graph: ``bench e2e``'s full-graph) fits on
                    the GPU beside the weights
    louiskv/split   the largest batch whose KV fits on the GPU and in pinned host memory together:
                    placement "split", each layer's pool on the GPU while ``gpu_pool_bytes`` allows,
                    the other layers' pinned (``kvpolicy.placement``); graph-replayed through
                    ``DecodeGraph`` like ``bench e2e``'s policy rows

The model is ``bench e2e``'s: random weights of Qwen3-8B's shape, a context of random KV laid
straight into the cache (no prefill). louiskv's trigger is ``interval(n)`` at a measured
re-selection rate (random weights have no query dynamics), and its prompt units are random groups
of K-means' size (``bench layer``'s stand-in: K-means at ten 128K sequences would dominate the run)
unless ``kmeans=True``.

Batches are sized from bytes, never found by running out of memory: the full KV per sequence
(exact, from the config) against the GPU's available memory less a margin; for the split, the
pool per sequence against GPU plus host, where what else a sequence of louiskv holds on the GPU
(the attended buffers, the retrieval index, the pool's row table, the prefill's transient copies)
is measured once by a probe at batch 1 (``probe_device_bytes``). The pools go whole layers at a
time, so the split plan counts layers. A cell that still runs out of GPU memory backs off one
sequence (``BACKOFF`` times at most); host memory is never tried, only counted (pinning past it
could wake the kernel's OOM killer).
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass

import torch

from .. import pinned
from ..errors import KVPolicyError
from ..integrations.transformers import PolicyCache
from ..plan import PREFILL_RESERVE
from ..placement import device_available_bytes, device_total_bytes, host_available_bytes, pool_bytes
from ..policy import Policy, bytes_text
from . import BUDGET, LOUISKV_RATE
from .e2e import Throughput, full_throughput, lay_random_context, time_policy_decode

# kept free on the GPU beyond every planned byte (graph pools, kernel workspaces, allocator
# fragmentation), and on the host (the process, the OS); each at least the first figure
DEVICE_MARGIN = (2 << 30, 0.03)
HOST_MARGIN = (8 << 30, 0.10)
BACKOFF = 2  # retries, one sequence fewer each, after a cell runs out of GPU memory


@dataclass
class KVShape:
    """What one sequence's KV costs: ``layers`` pools of ``heads`` x ``dim`` per token."""

    layers: int
    heads: int
    dim: int
    element_size: int

    @classmethod
    def of(cls, config, dtype: torch.dtype) -> "KVShape":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, dim, torch.empty((), dtype=dtype).element_size())

    def layer_bytes(self, batch: int, slots: int) -> int:
        return pool_bytes(batch, self.heads, slots, self.dim, self.element_size)


@dataclass
class Memory:
    """Bytes a capacity run may plan with: on the GPU once the weights are resident, and on the host."""

    device: int
    host: int
    device_margin: int
    host_margin: int

    @classmethod
    def measure(cls, device: torch.device) -> "Memory":
        _release(device)
        pinned.release_unused()  # kept pools of an earlier run would count as taken
        return cls(device=device_available_bytes(device), host=host_available_bytes(),
                   device_margin=_margin(DEVICE_MARGIN, device_total_bytes(device)),
                   host_margin=_margin(HOST_MARGIN, device_total_bytes(torch.device("cpu"))))


def _margin(rule: tuple[int, float], total: int) -> int:
    least, share = rule
    return max(least, int(share * total))


@dataclass
class Plan:
    """A batch and where its KV goes; ``gpu_layers``/``gpu_pool_bytes``: the split's device side."""

    kind: str
    batch: int
    device_bytes: int  # planned on the GPU (pools, and for the split what else the sequences hold there)
    host_bytes: int  # planned pinned
    gpu_layers: int | None = None
    gpu_pool_bytes: int | None = None


def full_slots(context: int, steps: int) -> int:
    """Slots of ``full_throughput``'s StaticCache (``context + steps + 4``)."""
    return context + steps + 4


def plan_full(memory: Memory, shape: KVShape, context: int, steps: int) -> Plan:
    """The largest batch whose full KV fits on the GPU: every layer's cache, plus the one layer of
    random KV that is being copied in, within the available bytes less the margin."""
    per_sequence = shape.layers * shape.layer_bytes(1, full_slots(context, steps)) + shape.layer_bytes(1, context)
    batch = max(0, (memory.device - memory.device_margin) // per_sequence)
    return Plan("full-graph", batch, batch * per_sequence, 0)


def split_slots(context: int, steps: int) -> int:
    """Slots of a pool after prefill and ``DecodeGraph``'s reserve of ``steps + 2``."""
    return context + max(PREFILL_RESERVE, steps + 2)


def plan_split(memory: Memory, shape: KVShape, context: int, steps: int, device_per_sequence: int) -> Plan:
    """The largest batch whose pools fit on the GPU and the host together, whole layers on the GPU
    first; ``device_per_sequence``: what else one sequence holds on the GPU (``probe_device_bytes``)."""
    slots = split_slots(context, steps)
    host_room = max(memory.host - memory.host_margin, 0)
    device_room = memory.device - memory.device_margin
    per_sequence = shape.layers * shape.layer_bytes(1, slots)
    batch = max(0, (device_room + host_room) // max(per_sequence + device_per_sequence, 1))
    for batch in range(batch, 0, -1):
        pools_room = device_room - batch * device_per_sequence
        if pools_room < 0:
            continue
        layer = shape.layer_bytes(batch, slots)
        gpu_layers = min(shape.layers, pools_room // layer)
        host = (shape.layers - gpu_layers) * layer
        if host <= host_room:
            return Plan("louiskv/split", batch, gpu_layers * layer + batch * device_per_sequence, host,
                        gpu_layers, gpu_layers * layer)
    return Plan("louiskv/split", 0, 0, 0, 0, 0)


def capacity_policy(budget: int, backend: str, interval: int, *, gpu_pool_bytes: int | None = None,
                    placement: str = "split", kmeans: bool = False) -> Policy:
    from ..presets import preset
    from .layer import RandomGroups

    policy = preset("louiskv", budget=budget, backend=backend, placement=placement,
                    gpu_pool_bytes=gpu_pool_bytes if placement == "split" else None,
                    trigger={"name": "interval", "n": interval})
    if not kmeans:
        policy.prefill_units = RandomGroups()
    return policy


def _prefill(model, cache: PolicyCache, batch: int, context: int, seed: int) -> None:
    # one layer at a time: otherwise the host queues every layer's random KV and the peak holds
    # several (the probe's scaling by batch would then guess the pile-up)
    lay_random_context(model, cache, batch, context, seed, one_layer_at_a_time=True)


@torch.inference_mode()
def probe_device_bytes(model, policy: Policy, context: int, steps: int, seed: int = 0) -> int:
    """Peak GPU bytes one sequence of ``policy`` adds beside its pools: a prefill at batch 1 and
    the decode's reserve, the peak allocation less the bytes of the pools on the GPU (placement
    "gpu" pins nothing; "cpu" where one sequence's pools would not fit). CUDA only."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        raise KVPolicyError(f"the capacity probe measures GPU allocations; the model is on {device}")
    probe = policy
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with probe.apply(model) as session:
        cache = session.new_cache()
        try:
            _prefill(model, cache, 1, context, seed)
        except torch.cuda.OutOfMemoryError:
            raise KVPolicyError(f"bench capacity: one sequence of {policy.name} at context {context} does not fit on "
                                "the GPU (its probe ran out of memory); accepted: a smaller --contexts") from None
        states = cache.policy_layers()
        for state in states:
            state.wait_for_units()
            state.plan.reserve(steps + 2)
        torch.cuda.synchronize(device)
        pools = sum(s.store.pool.nbytes() for s in states if s.store.pool.device.type == "cuda")
        peak = torch.cuda.max_memory_allocated(device) - base
    session.cache = None  # the session outlives the block: let its cache go before the next cell
    del cache, states
    _release(device)
    return max(peak - pools, 0)


@dataclass
class SplitThroughput(Throughput):
    pool_device_bytes: int = 0
    pool_host_bytes: int = 0
    pool_device_layers: int = 0


def split_throughput(model, policy: Policy, batch: int, context: int, steps: int, *, emulate: bool = False,
                     seed: int = 0, branches: str = "auto") -> SplitThroughput:
    """``policy_throughput`` that also reports where the pools went (the random KV laid one layer
    at a time: see ``_prefill``)."""
    ms, stats = time_policy_decode(model, policy, batch, context, steps, emulate=emulate, seed=seed,
                                   branches=branches, one_layer_at_a_time=True, with_stats=True)
    return SplitThroughput(policy.name + "/" + policy.placement, batch, context, steps, ms,
                           miss_fraction=stats.miss_fraction_warm, pool_device_bytes=stats.pool_device_bytes,
                           pool_host_bytes=stats.pool_host_bytes,
                           pool_device_layers=len(stats.pool_device_layers or []))


def _backing_off(run, batch: int, device: torch.device, label: str, say):
    """``run(batch)``, one sequence fewer after each GPU out-of-memory (``BACKOFF`` times at most)."""
    for attempt in range(BACKOFF + 1):
        try:
            return run(batch), batch
        except torch.cuda.OutOfMemoryError:
            if attempt == BACKOFF or batch <= 1:
                raise
        # out of the handler, the failed attempt's frames (its cache, its pools) are gone
        _release(device)
        say(f"{label}: batch {batch} ran out of GPU memory; trying {batch - 1}")
        batch -= 1
    raise AssertionError("unreachable")


def _release(device: torch.device) -> None:
    """Free what a finished cell left: its reference cycles (layer state and trigger state), then the
    allocator's cached blocks, so the next cell's figures start from the same free memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class CapacityRow:
    kind: str
    batch: int
    context: int
    steps: int
    ms_per_step: float | None
    tokens_per_s: float | None
    planned_batch: int
    pool_device_bytes: int
    pool_host_bytes: int
    pool_device_layers: int | None
    speedup_vs_full: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def measure_capacity(model, context: int, steps: int, *, budget: int = BUDGET, backend: str = "triton",
                     rate: float = LOUISKV_RATE, kmeans: bool = False, memory: Memory | None = None,
                     device_per_sequence: int | None = None, emulate: bool | None = None, branches: str = "auto",
                     say=print, on_row=None) -> list[CapacityRow]:
    """The two rows at ``context``. ``memory`` and ``device_per_sequence`` are measured on the
    model's device unless given (given: a run on the CPU, as the tests do). ``on_row(row)`` is
    called as each row is measured (so a later cell that fails leaves the earlier on record)."""
    device = next(model.parameters()).device
    emulate = device.type != "cuda" if emulate is None else emulate
    shape = KVShape.of(model.config, model.dtype)
    interval = max(1, round(1 / rate))
    # interval(n) re-selects once in any n consecutive steps: time whole intervals, or the row may
    # hold no re-selection at all (session 7's first run: 5 steps of interval(9), a reusing step only)
    whole = interval * -(-steps // interval)
    if whole != steps:
        say(f"timing {whole} steps, not {steps}: whole intervals of interval({interval})")
        steps = whole
    memory = memory or Memory.measure(device)
    say(f"memory: {bytes_text(memory.device)} available on {device} (weights resident; margin "
        f"{bytes_text(memory.device_margin)}), {bytes_text(memory.host)} on the host (margin "
        f"{bytes_text(memory.host_margin)}); full KV {bytes_text(shape.layers * shape.layer_bytes(1, context))} "
        f"a sequence at {context} tokens")
    full_plan = plan_full(memory, shape, context, steps)
    if device_per_sequence is None:
        # pools on the GPU where one sequence's fit beside the weights (no pinning), else pinned
        sequence_pools = shape.layers * shape.layer_bytes(1, split_slots(context, steps))
        on_gpu = sequence_pools < (memory.device - memory.device_margin) // 2
        probe = capacity_policy(budget, backend, interval, placement="gpu" if on_gpu else "cpu", kmeans=kmeans)
        device_per_sequence = probe_device_bytes(model, probe, context, steps)
        say(f"louiskv holds {bytes_text(device_per_sequence)} a sequence on the GPU beside its pools (probe at "
            f"batch 1, pools on the {'GPU' if on_gpu else 'host'})")
    split_plan = plan_split(memory, shape, context, steps, device_per_sequence)
    say(f"planned: full-graph batch {full_plan.batch} ({bytes_text(full_plan.device_bytes)} of KV on the GPU); "
        f"louiskv/split batch {split_plan.batch} ({split_plan.gpu_layers} of {shape.layers} layers' pools on the GPU, "
        f"{bytes_text(split_plan.gpu_pool_bytes or 0)}, the rest pinned, {bytes_text(split_plan.host_bytes)})")
    if full_plan.batch == 0 and split_plan.batch == 0:
        raise KVPolicyError(
            f"bench capacity: nothing fits at context {context}: a sequence's KV is "
            f"{bytes_text(shape.layers * shape.layer_bytes(1, context))} and {bytes_text(memory.device)} GPU + "
            f"{bytes_text(memory.host)} host memory are available; accepted: a --contexts value small enough for "
            "one sequence"
        )
    rows: list[CapacityRow] = []

    def add(row: CapacityRow) -> None:
        full = rows[0].tokens_per_s if rows else row.tokens_per_s
        row.speedup_vs_full = row.tokens_per_s / full if full and row.tokens_per_s else None
        rows.append(row)
        if on_row is not None:
            on_row(row)

    if full_plan.batch == 0:
        say(f"full-graph: not one sequence of {context} tokens fits on the GPU")
        add(CapacityRow("full-graph", 0, context, steps, None, None, 0, 0, 0, None))
    else:
        result, batch = _backing_off(
            lambda b: full_throughput(model, "full-graph", b, context, steps, backend=backend),
            full_plan.batch, device, "full-graph", say)
        add(CapacityRow("full-graph", batch, context, steps, result.ms_per_step, result.tokens_per_s,
                        full_plan.batch, shape.layers * shape.layer_bytes(batch, full_slots(context, steps)),
                        0, shape.layers))
        _release(device)
    if split_plan.batch == 0:
        say("louiskv/split: not one sequence fits")
        add(CapacityRow("louiskv/split", 0, context, steps, None, None, 0, 0, 0, None))
    else:
        def run(batch: int) -> SplitThroughput:
            # a smaller batch keeps the same layers on the GPU, at its smaller pool size
            gpu_pool = split_plan.gpu_layers * shape.layer_bytes(batch, split_slots(context, steps))
            policy = capacity_policy(budget, backend, interval, gpu_pool_bytes=gpu_pool, kmeans=kmeans)
            return split_throughput(model, policy, batch, context, steps, emulate=emulate, branches=branches)

        result, batch = _backing_off(run, split_plan.batch, device, "louiskv/split", say)
        add(CapacityRow("louiskv/split", batch, context, steps, result.ms_per_step, result.tokens_per_s,
                        split_plan.batch, result.pool_device_bytes, result.pool_host_bytes, result.pool_device_layers))
    return rows
