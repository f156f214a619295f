"""Placement "split": each layer's KV pool on the attention device while a byte limit allows,
the rest in (pinned) host memory. On a CPU the device side is the CPU itself, so these tests
check the split's rules (which layers go where, the limit through growth, the errors) and that
a split decodes exactly what one pool place does; the CUDA test checks the pools' real devices.
"""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import cli
from kvpolicy.cli.run import placement_options
from kvpolicy.errors import ConfigError, KVPolicyError
from kvpolicy.graph import DecodeGraph
from kvpolicy.integrations.transformers import cache_argument_name
from kvpolicy.plan import SplitPlan
from kvpolicy.placement import PoolPlacer, check_limit, pool_bytes

from conftest import build_model, left_padded_batch

pytestmark = pytest.mark.usefixtures("single_thread")

LAYERS = 4
PROMPT = 200
HEADS, DIM = 2, 16  # conftest's TINY shape
RESERVE = 256  # TieredStore.from_prefill's slots past the prompt


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", num_hidden_layers=LAYERS)


def layer_pool(batch: int, capacity: int = PROMPT + RESERVE) -> int:
    return pool_bytes(batch, HEADS, capacity, DIM, 4)  # float32


def policy(**options) -> kvpolicy.Policy:
    return kvpolicy.preset("louiskv", budget=96, trigger={"name": "interval", "n": 4}, **options)


def generate(model, pol, new_tokens: int):
    ids, mask = left_padded_batch(PROMPT)
    with pol.apply(model) as session:
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        return out, session.stats(), session.cache


def device_pool_bytes(cache) -> int:
    return sum(2 * s.store.pool.keys.numel() * s.store.pool.keys.element_size()
               for s in cache.policy_layers() if s.plan.pool_on_device)


def test_the_first_layers_that_fit_the_limit_take_the_device(llama):
    ids, _ = left_padded_batch(PROMPT)
    batch = ids.shape[0]
    # room for two layers' pools and most of a third: the third goes to the host, so does the fourth
    limit = 2 * layer_pool(batch) + layer_pool(batch) // 2
    out, stats, cache = generate(llama, policy(placement="split", gpu_pool_bytes=limit), new_tokens=8)
    assert [s.plan.pool_on_device for s in cache.policy_layers()] == [True, True, False, False]
    assert stats.pool_device_layers == [0, 1]
    assert stats.pool_device_bytes == 2 * layer_pool(batch) == cache.placer.used
    assert stats.pool_host_bytes == 2 * layer_pool(batch)
    assert all(isinstance(s.plan, SplitPlan) for s in cache.policy_layers())


# limit in prompt pools -> the layers whose device pool moved to the host as it grew, and those
# left on the device: pools grow in layer order, each while it is copied counted twice
GROWTH = {
    0: ([], []),
    2: ([0, 1], []),  # each doubling needs 2 more pools' room than the limit has
    LAYERS: ([0, 1, 3], [2]),  # once 0 and 1 left, 2 doubles in place; then 3 finds no room
}


@pytest.mark.parametrize("limit_pools", sorted(GROWTH))
def test_a_split_decodes_what_a_host_pool_decodes(llama, limit_pools):
    """Past the prompt's reserve every pool doubles; a device pool whose growth would pass the
    limit moves to the host first. Tokens and scores are those of placement cpu, bit for bit."""
    ids, _ = left_padded_batch(PROMPT)
    batch = ids.shape[0]
    new_tokens = RESERVE + 24  # the pools grow once
    limit = limit_pools * layer_pool(batch)
    reference, _, _ = generate(llama, policy(placement="cpu"), new_tokens)
    out, stats, cache = generate(llama, policy(placement="split", gpu_pool_bytes=limit), new_tokens)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores))
    moved, stayed = GROWTH[limit_pools]
    assert cache.placer.moved_layers == moved and stats.pool_device_layers == stayed
    assert cache.placer.used == device_pool_bytes(cache) == stats.pool_device_bytes <= limit
    grown = layer_pool(batch, 2 * (PROMPT + RESERVE))
    assert stats.pool_device_bytes + stats.pool_host_bytes == LAYERS * grown


@pytest.mark.parametrize("limit_pools", [2, LAYERS])
def test_a_pool_attended_by_slot_that_moves_decodes_what_a_host_pool_decodes(llama, limit_pools,
                                                                             pools_attended_by_slot):
    """A device pool attended by slot copies the retrieved rows into its buffer before it moves
    (``stop_attending_pool``): from then on the buffer's rows are read, and reused by the next
    re-selection. Tokens and scores are still placement cpu's, bit for bit."""
    ids, _ = left_padded_batch(PROMPT)
    new_tokens = RESERVE + 24  # the pools grow once
    limit = limit_pools * layer_pool(ids.shape[0])
    # the pools move before step 256, which re-selects at no interval of 5: the next steps
    # attend the rows the buffer took when its pool moved
    every_5 = {"budget": 96, "trigger": {"name": "interval", "n": 5}}
    reference, _, _ = generate(llama, kvpolicy.preset("louiskv", placement="cpu", **every_5), new_tokens)
    out, _, cache = generate(llama, kvpolicy.preset("louiskv", placement="split", gpu_pool_bytes=limit, **every_5),
                             new_tokens)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores))
    moved = GROWTH[limit_pools][0]
    assert cache.placer.moved_layers == moved
    stores = [s.store for s in cache.policy_layers()]
    # the moved layers stopped attending their pool; a layer that stayed still does
    assert not any(stores[i].attends_pool_by_slot for i in moved)
    assert all(stores[i].attends_pool_by_slot for i in GROWTH[limit_pools][1])


# the louiskv preset's SmolLM2 trigger: its outlier keys are read from the pool at prefill, wherever it is
OUTLIER_TRIGGER = {"name": "score_gap", "margin": -0.5, "measure": "mass", "leaving": "ignored", "estimate": "outlier",
                   "outliers": 4, "group": "each"}


def test_the_outlier_trigger_reads_its_keys_from_a_pool_on_either_side(llama, monkeypatch):
    """The outlier keys are taken from each layer's pool at prefill, on the unit table's device, a few KV heads
    at a time: a split (two layers' pools on the host) decodes what placement cpu does, bit for bit, and a
    head a chunk takes the keys the whole sequence at once does."""
    from kvpolicy.triggers import outlier_keys

    ids, _ = left_padded_batch(PROMPT)
    options = {"budget": 96, "trigger": OUTLIER_TRIGGER}
    reference, _, _ = generate(llama, kvpolicy.preset("louiskv", placement="cpu", **options), 8)
    out, _, cache = generate(llama, kvpolicy.preset("louiskv", placement="split", gpu_pool_bytes=2 * layer_pool(
        ids.shape[0]), **options), 8)
    assert torch.equal(out.sequences, reference.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.scores, reference.scores))
    monkeypatch.setattr(outlier_keys, "_CHUNK_BYTES", 1)  # a KV head a chunk
    assert len(outlier_keys._head_chunks(HEADS, PROMPT, DIM)) == HEADS
    for s in cache.policy_layers():
        kept = s.trigger_state.outliers
        again = outlier_keys.take_outlier_keys(s.units, s.store, 4)
        assert all(torch.equal(a, b) for a, b in zip(again, kept))


def test_a_reserve_before_capture_keeps_the_limit(llama):
    """DecodeGraph reserves its steps up front: that growth follows the same rule."""
    ids, mask = left_padded_batch(PROMPT)
    batch = ids.shape[0]
    limit = 3 * layer_pool(batch)
    pol = policy(placement="split", gpu_pool_bytes=limit)
    with pol.apply(llama) as session, torch.inference_mode():
        cache = session.new_cache()
        llama(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_argument_name(llama): cache})
        assert cache.placer.device_layers() == [0, 1, 2]
        positions = mask.sum(-1)
        DecodeGraph(llama, cache, positions, steps=2 * RESERVE, emulate=True)
        # room for 712 slots is 1.56 prompt pools: 0 and 1 must leave for 2 to grow in place
        assert cache.placer.moved_layers == [0, 1] and cache.placer.device_layers() == [2]
        assert device_pool_bytes(cache) == cache.placer.used <= limit
        assert all(s.store.pool.keys.shape[2] >= PROMPT + 2 * RESERVE for s in cache.policy_layers())


def test_free_memory_sizing_leaves_the_headroom(llama, monkeypatch):
    """gpu_pool_bytes=None: a layer takes the device while what is available after its pool
    stays above the headroom (here a fake device of a few pools' size)."""
    ids, _ = left_padded_batch(PROMPT)
    batch = ids.shape[0]
    total = 5 * layer_pool(batch)
    taken = []

    def available(device):
        return total - sum(taken)

    import kvpolicy.placement as placement

    monkeypatch.setattr(placement, "device_free_bytes", available)
    monkeypatch.setattr(placement, "auto_headroom", lambda device: 2 * layer_pool(batch))
    real_place = PoolPlacer.place

    def place(self, layer_idx, nbytes):
        where = real_place(self, layer_idx, nbytes)
        if self.layers[layer_idx]:
            taken.append(nbytes)
        return where

    monkeypatch.setattr(PoolPlacer, "place", place)
    _, stats, cache = generate(llama, policy(placement="split"), new_tokens=4)
    # 5 pools of room, 2 kept free: three layers fit
    assert stats.pool_device_layers == [0, 1, 2]
    assert cache.placer.limit is None and cache.placer.headroom == 2 * layer_pool(batch)


def test_placer_rules_from_byte_figures():
    placer = PoolPlacer(torch.device("cpu"), limit=100)
    assert [placer.place(i, 40) for i in range(3)] == [torch.device("cpu")] * 3
    assert placer.device_layers() == [0, 1] and placer.host_layers() == [2] and placer.used == 80
    assert not placer.grow(0, 40, 80)  # 80 + 80 > 100 while the old pool is still there
    placer.moved(0, 40)
    assert placer.used == 40 and placer.device_layers() == [1] and placer.moved_layers == [0]
    assert placer.grow(1, 40, 60) and placer.used == 60  # 40 + 60 <= 100, and counted
    assert not placer.grow(2, 40, 80)  # a host pool never grows onto the device
    zero = PoolPlacer(torch.device("cpu"), limit=0)
    assert zero.place(0, 1) == torch.device("cpu") and zero.layers == {0: False}


def test_under_a_limit_a_pool_never_takes_the_devices_last_gigabyte():
    """The guard reads the device's real free memory; a "meta" device stands for a GPU here."""
    from kvpolicy.placement import LIMIT_GUARD_BYTES

    free = {"bytes": LIMIT_GUARD_BYTES + 100}
    placer = PoolPlacer(torch.device("meta"), limit=1 << 40, available=lambda device: free["bytes"])
    assert placer.place(0, 100) == torch.device("meta")  # leaves exactly the guard
    free["bytes"] -= 100
    assert placer.place(1, 1) == torch.device("cpu")  # within the limit, but the device is at its guard
    assert placer.device_layers() == [0] and placer.used == 100


def test_a_limit_the_device_cannot_hold_is_refused_when_applied(llama):
    pol = policy(placement="split", gpu_pool_bytes=1 << 62)
    with pytest.raises(KVPolicyError) as error:
        pol.apply(llama)
    message = str(error.value)
    assert "\n" not in message
    assert "gpu_pool_bytes=4611686018427387904" in message and "exceeds" in message
    assert "accepted: an integer from 0 to" in message and "or None to size it from free memory" in message


def test_check_limit_uses_the_available_bytes_it_is_given():
    check_limit(1000, torch.device("cpu"), available=lambda device: 1000)
    check_limit(None, torch.device("cpu"), available=lambda device: 0)
    with pytest.raises(KVPolicyError, match=r"exceeds the 999 bytes \(999B\) available on cpu"):
        check_limit(1000, torch.device("cpu"), available=lambda device: 999)


@pytest.mark.parametrize("options, expected", [
    ({"placement": "nvme"}, "unknown placement 'nvme'; accepted: cpu, gpu, split"),
    ({"placement": "cpu", "gpu_pool_bytes": 1 << 30}, "gpu_pool_bytes applies only to placement='split'"),
    ({"placement": "split", "gpu_pool_bytes": -1}, "gpu_pool_bytes must be an integer >= 0 (bytes), or None"),
    ({"placement": "split", "gpu_pool_bytes": 1.5}, "gpu_pool_bytes must be an integer >= 0"),
    ({"placement": "split", "gpu_pool_bytes": True}, "gpu_pool_bytes must be an integer >= 0"),
])
def test_bad_split_fields_are_one_line_errors(options, expected):
    with pytest.raises(ConfigError) as error:
        policy(**options)
    assert expected in str(error.value) and "\n" not in str(error.value)


def test_describe_and_spec_show_the_split():
    assert "placement=split(gpu_pool=40.0GiB)" in policy(placement="split", gpu_pool_bytes=40 << 30).describe()
    assert "placement=split(gpu_pool=free)" in policy(placement="split").describe()
    spec = policy(placement="split", gpu_pool_bytes=1 << 20).to_dict()
    assert spec["placement"] == "split" and spec["gpu_pool_bytes"] == 1 << 20
    assert kvpolicy.Policy.from_dict(spec) == policy(placement="split", gpu_pool_bytes=1 << 20)
    assert "gpu_pool_bytes" not in policy(placement="cpu").to_dict()  # other specs keep their keys


@pytest.mark.parametrize("text, expected", [
    ("split", {"placement": "split"}),
    ("split:1.5", {"placement": "split", "gpu_pool_bytes": 3 << 29}),
    ("split:0", {"placement": "split", "gpu_pool_bytes": 0}),
    ("gpu", {"placement": "gpu"}),
])
def test_cli_placement_values(text, expected):
    assert placement_options(text) == expected


@pytest.mark.parametrize("text", ["nvme", "split:", "split:lots", "split:-1", "split:inf", "cpu:4"])
def test_cli_bad_placement_is_one_line_error_before_the_model_loads(text, monkeypatch, capsys):
    def load_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr("kvpolicy.models.load_model", load_model)
    assert cli.main(["run", "--preset", "louiskv", "--placement", text, "--device", "cpu"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"kvpolicy: error: --placement takes cpu, gpu, split or split:GIB (GiB of KV pool on the "
                       f"GPU, a number >= 0), got {text!r}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_split_puts_pools_on_the_device_and_pinned_host():
    model = build_model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = left_padded_batch(PROMPT)
    ids, mask = ids.cuda(), mask.cuda()
    batch = ids.shape[0]
    outs = {}
    for name, pol in (("gpu", policy(placement="gpu")),
                      ("split", policy(placement="split", gpu_pool_bytes=2 * layer_pool(batch)))):
        with pol.apply(model) as session:
            outs[name] = model.generate(ids, attention_mask=mask, max_new_tokens=RESERVE + 24, do_sample=False)
            states = session.cache.policy_layers()
            if name == "split":
                placer = session.cache.placer
                assert placer.moved_layers == [0, 1]
                for s in states:
                    assert s.store.pool.keys.device.type == "cpu" and s.store.pool.keys.is_pinned()
    assert torch.equal(outs["gpu"], outs["split"])
    with policy(placement="split", gpu_pool_bytes=2 * layer_pool(batch)).apply(model) as session:
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        kinds = [(s.store.pool.keys.device.type, s.store.pool.keys.is_pinned()) for s in session.cache.policy_layers()]
    assert kinds == [("cuda", False), ("cuda", False), ("cpu", True), ("cpu", True)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_outlier_trigger_takes_its_keys_from_a_pinned_pool():
    """The outlier keys of a layer whose pool is in pinned host memory are taken on the GPU (session 34: the
    pool's zone rows stayed on the GPU while its keys were gathered on the host, and the prefill failed)."""
    model = build_model("llama", num_hidden_layers=LAYERS).cuda()
    ids, mask = left_padded_batch(PROMPT)
    ids, mask = ids.cuda(), mask.cuda()
    options = {"budget": 96, "trigger": OUTLIER_TRIGGER}
    outs = {}
    for placement in ("gpu", "cpu", "split"):
        limit = {"gpu_pool_bytes": 2 * layer_pool(ids.shape[0])} if placement == "split" else {}
        with kvpolicy.preset("louiskv", placement=placement, **options, **limit).apply(model) as session:
            outs[placement] = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
            assert all(s.trigger_state.outliers.keys.device.type == "cuda" for s in session.cache.policy_layers())
    assert torch.equal(outs["gpu"], outs["cpu"]) and torch.equal(outs["gpu"], outs["split"])
