"""`kvpolicy bench capacity`: the batch sizing from byte figures, the back-off, the errors, and
the whole run on a tiny model on the CPU with given memory figures (the CPU is then the "GPU"
side of the split), so the wiring is checked before an H200 runs it."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import cli
from kvpolicy.cli import bench as bench_cli
from kvpolicy.bench import capacity
from kvpolicy.bench.capacity import (KVShape, Memory, full_slots, measure_capacity, plan_full, plan_split,
                                     split_slots)
from kvpolicy.errors import KVPolicyError

from conftest import build_model

QWEN3_8B = KVShape(layers=36, heads=8, dim=128, element_size=2)
GIB = 1 << 30
CONTEXT, STEPS = 131072, 50


def h200(device_gib: float = 124.0, host_gib: float = 120.0) -> Memory:
    """Figures of the size an H200 with the 8B weights resident and a 128 GiB host give."""
    return Memory(device=int(device_gib * GIB), host=int(host_gib * GIB), device_margin=4 * GIB, host_margin=13 * GIB)


def full_fits(memory: Memory, shape: KVShape, batch: int) -> bool:
    need = batch * (shape.layers * shape.layer_bytes(1, full_slots(CONTEXT, STEPS)) + shape.layer_bytes(1, CONTEXT))
    return need <= memory.device - memory.device_margin


def split_fits(memory: Memory, shape: KVShape, batch: int, per_sequence: int) -> bool:
    """Whether some whole number of layers on the GPU leaves the rest within the host's room."""
    layer = shape.layer_bytes(batch, split_slots(CONTEXT, STEPS))
    device_room = memory.device - memory.device_margin - batch * per_sequence
    host_room = max(memory.host - memory.host_margin, 0)
    return any(k * layer <= device_room and (shape.layers - k) * layer <= host_room for k in range(shape.layers + 1))


@pytest.mark.parametrize("device_gib", [20.0, 124.0, 300.0])
def test_full_batch_is_the_largest_that_fits(device_gib):
    memory = h200(device_gib)
    plan = plan_full(memory, QWEN3_8B, CONTEXT, STEPS)
    assert full_fits(memory, QWEN3_8B, plan.batch) and not full_fits(memory, QWEN3_8B, plan.batch + 1)
    assert plan.host_bytes == 0 and plan.device_bytes <= memory.device - memory.device_margin


@pytest.mark.parametrize("device_gib, host_gib, per_sequence", [
    (124.0, 120.0, 1 * GIB), (124.0, 20.0, 1 * GIB), (124.0, 120.0, 0), (40.0, 400.0, 2 * GIB), (124.0, 13.0, GIB),
    (124.0, 2.0, GIB),  # less host memory than its margin: the GPU alone
])
def test_split_batch_is_the_largest_whose_layers_fit_gpu_and_host(device_gib, host_gib, per_sequence):
    memory = h200(device_gib, host_gib)
    plan = plan_split(memory, QWEN3_8B, CONTEXT, STEPS, per_sequence)
    assert plan.batch >= 1
    assert split_fits(memory, QWEN3_8B, plan.batch, per_sequence)
    assert not split_fits(memory, QWEN3_8B, plan.batch + 1, per_sequence)
    layer = QWEN3_8B.layer_bytes(plan.batch, split_slots(CONTEXT, STEPS))
    assert plan.gpu_pool_bytes == plan.gpu_layers * layer
    assert plan.host_bytes == (QWEN3_8B.layers - plan.gpu_layers) * layer <= max(memory.host - memory.host_margin, 0)
    assert plan.device_bytes == plan.gpu_pool_bytes + plan.batch * per_sequence <= memory.device - memory.device_margin
    # with the host's room the split holds at least what the GPU alone holds
    assert plan.batch >= plan_full(memory, QWEN3_8B, CONTEXT, STEPS).batch or per_sequence > 0


def test_split_plan_of_nothing_is_batch_zero():
    memory = Memory(device=GIB, host=GIB, device_margin=GIB // 2, host_margin=GIB)
    assert plan_split(memory, QWEN3_8B, CONTEXT, STEPS, 0).batch == 0
    assert plan_full(memory, QWEN3_8B, CONTEXT, STEPS).batch == 0


def test_back_off_tries_one_sequence_fewer_after_an_out_of_memory():
    tried, said = [], []

    def run(batch):
        tried.append(batch)
        if batch > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return f"ran {batch}"

    assert capacity._backing_off(run, 5, torch.device("cpu"), "full-graph", said.append) == ("ran 3", 3)
    assert tried == [5, 4, 3] and said[0] == "full-graph: batch 5 ran out of GPU memory; trying 4"
    tried.clear()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        capacity._backing_off(run, 9, torch.device("cpu"), "full-graph", said.append)
    assert tried == [9, 8, 7]  # BACKOFF retries, then the error


@pytest.fixture(scope="module")
def tiny():
    return build_model("qwen3", num_hidden_layers=4)


def test_a_capacity_run_on_the_cpu_follows_its_plans(tiny):
    shape = KVShape.of(tiny.config, tiny.dtype)
    context, steps, per_sequence = 300, 4, 4096
    assert split_slots(context, steps) != full_slots(context, steps)
    full_sequence = shape.layers * shape.layer_bytes(1, full_slots(context, steps)) + shape.layer_bytes(1, context)
    # a "GPU" of three full sequences, and a host of two layers' pools at four sequences
    memory = Memory(device=3 * full_sequence + 100, host=2 * shape.layer_bytes(4, split_slots(context, steps)) + 10,
                    device_margin=100, host_margin=10)
    said = []
    rows = measure_capacity(tiny, context, steps, budget=128, backend="reference", rate=0.25, memory=memory,
                            device_per_sequence=per_sequence, say=said.append)
    full, split = rows
    split_plan = plan_split(memory, shape, context, steps, per_sequence)
    assert (full.kind, split.kind) == ("full-graph", "louiskv/split")
    assert full.batch == full.planned_batch == plan_full(memory, shape, context, steps).batch == 3
    assert split.batch == split.planned_batch == split_plan.batch > full.batch
    # the split run put exactly the planned layers' pools on the device side, the rest on the host
    layer = shape.layer_bytes(split.batch, split_slots(context, steps))
    assert split.pool_device_layers == split_plan.gpu_layers
    assert split.pool_device_bytes == split_plan.gpu_layers * layer
    assert split.pool_host_bytes == (shape.layers - split_plan.gpu_layers) * layer == split_plan.host_bytes
    for row in rows:
        assert row.ms_per_step > 0 and row.tokens_per_s == pytest.approx(row.batch * 1e3 / row.ms_per_step)
    assert split.speedup_vs_full == pytest.approx(split.tokens_per_s / full.tokens_per_s)
    assert said[0].startswith("memory: ")


def test_the_timed_steps_are_whole_intervals_of_the_trigger(tiny):
    # interval(4) (rate 0.25) over 5 steps could hold one re-selection or two; 8 hold exactly two
    shape = KVShape.of(tiny.config, tiny.dtype)
    context = 300
    layer = shape.layer_bytes(1, split_slots(context, 8))
    memory = Memory(device=2 * shape.layers * layer + 10, host=4 * shape.layers * layer + 10, device_margin=10,
                    host_margin=10)
    said = []
    rows = measure_capacity(tiny, context, 5, budget=128, backend="reference", rate=0.25, memory=memory,
                            device_per_sequence=0, say=said.append)
    assert [row.steps for row in rows] == [8, 8]
    assert "timing 8 steps, not 5: whole intervals of interval(4)" in said


def test_a_run_where_nothing_fits_is_a_one_line_error(tiny):
    memory = Memory(device=1000, host=1000, device_margin=900, host_margin=900)
    with pytest.raises(KVPolicyError) as error:
        measure_capacity(tiny, 300, 4, budget=128, backend="reference", rate=0.25, memory=memory, device_per_sequence=0,
                         say=lambda message: None)
    message = str(error.value)
    assert "\n" not in message and message.startswith("bench capacity: nothing fits at context 300")
    assert "accepted: a --contexts value small enough for one sequence" in message


def test_full_attention_that_fits_nothing_leaves_the_split_row(tiny):
    shape = KVShape.of(tiny.config, tiny.dtype)
    context, steps = 300, 4
    layer = shape.layer_bytes(1, split_slots(context, steps))
    memory = Memory(device=layer + 10, host=shape.layers * layer + 10, device_margin=10, host_margin=10)
    rows = measure_capacity(tiny, context, steps, budget=128, backend="reference", rate=0.25, memory=memory,
                            device_per_sequence=0, say=lambda message: None)
    assert rows[0].batch == 0 and rows[0].tokens_per_s is None and rows[0].speedup_vs_full is None
    assert rows[1].batch >= 1 and rows[1].tokens_per_s > 0


@pytest.mark.parametrize("argv, message", [
    (["bench", "capacity", "--device", "cpu"],
     "bench capacity sizes its batches from GPU and pinned host memory, so it needs a CUDA --device; got cpu"),
])
def test_cli_capacity_refuses_what_it_cannot_run(argv, message, capsys):
    assert cli.main(argv) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"kvpolicy: error: {message}"


def test_cli_capacity_prints_and_writes_both_rows(tmp_path, monkeypatch, capsys):
    """The CLI's capacity wiring on the CPU: a tiny Qwen3 in place of the 8B shape, memory figures
    and the probe's bytes given (both read a GPU)."""
    import json
    from argparse import Namespace

    import transformers

    from conftest import TINY

    config = transformers.Qwen3Config(**{**TINY, "num_hidden_layers": 4, "use_sliding_window": False})
    shape = KVShape.of(config, torch.bfloat16)
    context, steps = 300, 4
    layer = shape.layer_bytes(1, split_slots(context, steps))
    memory = Memory(device=2 * shape.layers * layer + 10, host=4 * shape.layers * layer + 10, device_margin=10,
                    host_margin=10)
    monkeypatch.setattr("kvpolicy.bench.ttft.qwen3_8b_config", lambda layers: config)
    monkeypatch.setattr(capacity.Memory, "measure", classmethod(lambda cls, device: memory))
    monkeypatch.setattr(capacity, "probe_device_bytes", lambda *args, **kwargs: 1024)
    out = tmp_path / "capacity.json"
    args = Namespace(contexts=str(context), layers=4, rate=0.25, budget=128, steps=steps, kmeans=False,
                     backend="reference", branches="auto", compiled_layers=False)
    rows = bench_cli.BenchRows(str(out), {"device": "cpu"})
    bench_cli.capacity(args, torch.device("cpu"), rows)
    written = json.loads(out.read_text())["rows"]
    assert [r["kind"] for r in written] == ["full-graph", "louiskv/split"]
    assert written[1]["batch"] > written[0]["batch"] >= 1
    assert written[1]["speedup_vs_full"] == pytest.approx(written[1]["tokens_per_s"] / written[0]["tokens_per_s"])
    printed = capsys.readouterr().out
    assert "interval(4) = 25.0% re-selection" in printed and "louiskv holds 1.0KiB a sequence on the GPU" in printed
    table = [line.split() for line in printed.splitlines()
             if line.startswith(("full-graph ", "louiskv/split ")) and line.split()[1].isdigit()]
    assert [(cells[0], int(cells[1])) for cells in table] == [(r["kind"], r["batch"]) for r in written]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the probe reads CUDA allocation counters")
def test_probe_counts_at_least_the_attended_buffers():
    model = build_model("qwen3", num_hidden_layers=4).cuda()
    shape = KVShape.of(model.config, model.dtype)
    policy = capacity.capacity_policy(128, "triton", 9, placement="gpu")
    probed = capacity.probe_device_bytes(model, policy, 300, 4)
    # every layer holds sink + retrieved + local rows of keys and values for the one sequence
    assert probed >= shape.layers * shape.layer_bytes(1, 128)


def test_memory_figures_of_this_machine_are_positive_with_their_margins():
    memory = Memory.measure(torch.device("cpu"))
    assert memory.device > 0 and memory.host > 0
    assert memory.device_margin >= capacity.DEVICE_MARGIN[0] and memory.host_margin >= capacity.HOST_MARGIN[0]


def test_rows_are_handed_on_as_they_come_so_a_failed_cell_keeps_the_earlier(tiny, monkeypatch):
    shape = KVShape.of(tiny.config, tiny.dtype)
    context, steps = 300, 4
    layer = shape.layer_bytes(1, split_slots(context, steps))
    memory = Memory(device=2 * shape.layers * layer + 10, host=4 * shape.layers * layer + 10, device_margin=10,
                    host_margin=10)

    def cannot_pin(*args, **kwargs):
        raise KVPolicyError("could not pin 123 bytes of host memory for the KV pool")

    monkeypatch.setattr(capacity, "split_throughput", cannot_pin)
    seen = []
    with pytest.raises(KVPolicyError, match="could not pin"):
        measure_capacity(tiny, context, steps, budget=128, backend="reference", rate=0.25, memory=memory,
                         device_per_sequence=0, say=lambda message: None, on_row=seen.append)
    assert [(r.kind, r.speedup_vs_full) for r in seen] == [("full-graph", 1.0)] and seen[0].tokens_per_s > 0
