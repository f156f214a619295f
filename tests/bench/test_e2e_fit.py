"""``bench e2e``'s cells that cannot fit say so before allocating (issue 13's 1M-token row).

Full attention at 1M tokens needs ~144 GiB of KV on the GPU; pinned pools past the host's memory
could wake the kernel's OOM killer rather than raise. The counts are checked against the bytes
written out here from the config, with the memory figures patched (no GPU needed)."""

from types import SimpleNamespace

import pytest
import torch

from kvpolicy import placement
from kvpolicy.bench import e2e
from kvpolicy.bench.capacity import DEVICE_MARGIN, HOST_MARGIN

GiB = 1 << 30
QWEN3_8B = SimpleNamespace(num_hidden_layers=36, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                           num_attention_heads=32)


def _stub(device: str):
    """What the checks read of a model: its config, dtype and a parameter's device."""
    return SimpleNamespace(config=QWEN3_8B, dtype=torch.bfloat16,
                           parameters=lambda: iter([SimpleNamespace(device=torch.device(device))]))


def _memory(monkeypatch, device_bytes: int, host_bytes: int, device_total=141 * GiB, host_total=128 * GiB):
    monkeypatch.setattr(placement, "device_available_bytes", lambda device: device_bytes)
    monkeypatch.setattr(placement, "host_available_bytes", lambda: host_bytes)
    monkeypatch.setattr(placement, "device_total_bytes",
                        lambda device: host_total if torch.device(device).type == "cpu" else device_total)


def _full_need(batch, context, steps):
    # 36 layers of keys and values, bf16, context + steps + 4 slots; plus one layer being laid in
    per_slot = 2 * batch * 8 * 128 * 2
    return 36 * per_slot * (context + steps + 4) + per_slot * context


def test_does_not_fit_is_an_out_of_memory_error():
    # the CLI's loop skips a cell on OutOfMemoryError and goes on to the next
    assert issubclass(e2e.DoesNotFit, torch.cuda.OutOfMemoryError)


def test_full_attention_at_1m_tokens_does_not_fit_an_h200(monkeypatch):
    _memory(monkeypatch, device_bytes=125 * GiB, host_bytes=110 * GiB)
    with pytest.raises(e2e.DoesNotFit, match="does not fit: full-graph at 1 x 1048576 tokens needs 148.0 GiB"):
        e2e.check_full_fits(_stub("cuda"), "full-graph", 1, 1 << 20, 18)
    e2e.check_full_fits(_stub("cuda"), "full-graph", 4, 1 << 17, 18)  # 4 x 128K: ~74 GiB, fits


def test_full_fit_boundary_is_the_kv_plus_the_margin(monkeypatch):
    need = _full_need(2, 50_000, 10)
    margin = max(DEVICE_MARGIN[0], int(DEVICE_MARGIN[1] * 141 * GiB))
    _memory(monkeypatch, device_bytes=need + margin, host_bytes=0)
    e2e.check_full_fits(_stub("cuda"), "full-graph", 2, 50_000, 10)
    _memory(monkeypatch, device_bytes=need + margin - 1, host_bytes=0)
    with pytest.raises(e2e.DoesNotFit):
        e2e.check_full_fits(_stub("cuda"), "full-graph", 2, 50_000, 10)


@pytest.mark.parametrize("placement_name,device_bytes,host_bytes,fits", [
    ("cpu", 130 * GiB, 115 * GiB, False),  # 1M pinned: ~144 GiB of pools past a 128 GiB host
    ("cpu", 10 * GiB, 240 * GiB, True),  # the same on a 256 GiB host (nvidia-h200-x2)
    ("gpu", 130 * GiB, 240 * GiB, False),  # on the GPU it cannot fit either
    ("split", 120 * GiB, 100 * GiB, True),  # both together hold it
])
def test_policy_pools_at_1m_tokens(monkeypatch, placement_name, device_bytes, host_bytes, fits):
    import kvpolicy

    _memory(monkeypatch, device_bytes=device_bytes, host_bytes=host_bytes,
            host_total=256 * GiB if host_bytes > 128 * GiB else 128 * GiB)
    policy = kvpolicy.preset("pariskv", budget=2048, placement=placement_name)
    if fits:
        e2e.check_policy_fits(_stub("cuda"), policy, 1, 1 << 20, 18)
    else:
        with pytest.raises(e2e.DoesNotFit, match="pariskv/" + placement_name):
            e2e.check_policy_fits(_stub("cuda"), policy, 1, 1 << 20, 18)


def test_full_throughput_refuses_before_allocating(monkeypatch):
    from conftest import build_model

    model = build_model("llama")
    _memory(monkeypatch, device_bytes=0, host_bytes=0)
    with pytest.raises(e2e.DoesNotFit):
        e2e.full_throughput(model, "full-graph", 1, 64, 2, backend="reference")



def test_the_sweep_row_says_what_does_not_fit(monkeypatch):
    """bench e2e's sweep yields the reason as the row's error (not "out of GPU memory", not a
    failure) and goes on to the next cell."""
    from kvpolicy.bench import sweeps

    from conftest import build_model

    def refuse(model, kind, batch, context, steps, **options):
        if context == 64:  # full-graph's cell; budget-floor (context 32) runs
            raise e2e.DoesNotFit("does not fit: full-graph at 1 x 64 tokens needs 9.0 GiB of KV")
        return e2e.Throughput(kind, batch, context, steps, 1.0)

    monkeypatch.setattr(e2e, "full_throughput", refuse)
    rows = list(sweeps.e2e(build_model("llama"), contexts=[64], batches=[1], cells=[], budget=32, steps=1,
                           backend="reference", full_kinds=["full-graph"], branch_kinds=["auto"], rate=0.1))
    assert rows[0]["kind"] == "full-graph"
    assert rows[0]["error"] == "does not fit: full-graph at 1 x 64 tokens needs 9.0 GiB of KV"
    assert not rows[0].get("failed")
    assert rows[1]["kind"] == "budget-floor" and "error" not in rows[1]


def test_a_row_that_runs_out_of_gpu_memory_says_what_it_tried_to_take(monkeypatch):
    """A cell that runs out of GPU memory is a row whose error carries the allocator's first line (what it
    tried to allocate), with its traceback in the row, and the sweep goes on."""
    from kvpolicy.bench import sweeps

    from conftest import build_model

    def short_of_memory(model, kind, batch, context, steps, **options):
        if context == 64:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nmore detail")
        return e2e.Throughput(kind, batch, context, steps, 1.0)

    monkeypatch.setattr(e2e, "full_throughput", short_of_memory)
    rows = list(sweeps.e2e(build_model("llama"), contexts=[64], batches=[1], cells=[], budget=32, steps=1,
                           backend="reference", full_kinds=["full-graph"], branch_kinds=["auto"], rate=0.1))
    assert rows[0]["error"] == "out of GPU memory: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert "short_of_memory" in rows[0]["traceback"] and not rows[0].get("failed")
    assert rows[1]["kind"] == "budget-floor" and "error" not in rows[1]


@pytest.mark.parametrize("name", ["pariskv", "louiskv"])
def test_a_split_row_decodes_over_the_device_and_the_host(name):
    """``--presets NAME@split`` (the 1M row on a host too small for a pinned pool): a step replays
    with one layer's pool on the device and the other's on the host."""
    import kvpolicy
    from kvpolicy.placement import pool_bytes
    from kvpolicy.plan import PREFILL_RESERVE

    from conftest import build_model

    model = build_model("llama")  # 2 layers
    config, context = model.config, 300
    one_layer = pool_bytes(1, config.num_key_value_heads, context + PREFILL_RESERVE, config.head_dim, 4)
    policy = kvpolicy.preset(name, budget=96, placement="split", gpu_pool_bytes=one_layer, backend="reference")
    ms, stats = e2e.time_policy_decode(model, policy, 1, context, 2, emulate=True, with_stats=True)
    assert ms > 0
    assert stats.pool_device_layers == [0] and stats.pool_device_bytes == stats.pool_host_bytes > 0
