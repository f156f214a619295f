"""benchmarks/pariskv_select.py runs end to end at a toy size on the CPU, and names bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from kvpolicy.errors import ConfigError

@pytest.fixture(scope="module")
def bench(benchmark_script):
    return benchmark_script("pariskv_select")


def test_a_toy_run_writes_both_paths_and_the_gather(bench, tmp_path):
    out = tmp_path / "select.json"
    bench.main(["--device", "cpu", "--contexts", "900", "--batches", "1", "--kv-heads", "2", "--q-heads", "4",
                "--head-dim", "32", "--budget", "160", "--update-buffer", "8", "--repeats", "1", "--json", str(out)])
    results = json.loads(out.read_text())
    fused, composed = results["selection"]
    assert (fused["path"], composed["path"]) == ("fused", "composed")
    assert fused["parts_ms"].keys() == {"query_votes", "collision_candidates", "rerank_select", "rest", "old_rerank"}
    assert composed["parts_ms"].keys() == {"encode_query", "collision_count", "candidate_topk", "rerank", "rest"}
    assert fused["append_ms"] > 0 and composed["append_ms"] > 0
    # the per-kernel profile (CPU ops on a toy run) and, with the reference backend, no methods
    assert fused["kernels_us"] and all(isinstance(name, str) and us >= 0 for name, us in fused["kernels_us"])
    assert fused["methods"] == {} and composed["kernels_us"] is None
    # the length rule below 5K tokens: half the zone, over both paths
    assert fused["candidates_per_row"] == composed["candidates_per_row"] == 450
    assert [row["order"] for row in results["gather"]] == ["random", "sorted", "selection"]
    assert all(row["bytes"] == 1 * 2 * (160 - 68) * 32 * 4 and row["copy_gbps"] > 0 for row in results["gather"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--contexts", "0"], "positive integers"),
        (["--contexts", "12k"], "comma-separated integers"),
        (["--q-heads", "30"], "must be a multiple of --kv-heads 8"),
        (["--budget", "100"], "leaves no room to retrieve"),
        (["--head-dim", "96"], "power of two"),
        (["--votes", "group_mean,max"], "comma-separated votes of group_mean, head_max"),
    ],
)
def test_bad_arguments_are_named(bench, argv, message, capsys):
    with pytest.raises((SystemExit, ConfigError)) as caught:
        bench.parse_args(["--device", "cpu", *argv])
    text = capsys.readouterr().err + str(caught.value)
    assert message in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_the_default_device_needs_cuda(bench, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "no CUDA device here (use --device cpu" in capsys.readouterr().err


def test_kernel_times_groups_the_kth_kernel_of_every_call(bench):
    calls = []

    def fn():
        calls.append(1)
        torch.ones(3).add_(1).sum()

    times = bench.kernel_times(fn, torch.device("cpu"), 3)
    assert len(calls) == 4  # a warm-up call, then the repeats
    assert [name for name, _ in times] == ["aten::ones", "aten::add_", "aten::sum"]
    assert bench._short("void at::native::(anonymous namespace)::sort<float>(int, float*)") == "sort"
    assert bench._short("_radix_level_kernel") == "_radix_level_kernel"


def test_votes_time_head_max_beside_group_mean(bench, tmp_path, capsys):
    out = tmp_path / "votes.json"
    bench.main(["--device", "cpu", "--contexts", "900", "--batches", "1", "--kv-heads", "2", "--q-heads", "8",
                "--head-dim", "32", "--budget", "160", "--update-buffer", "8", "--repeats", "1",
                "--votes", "group_mean,head_max", "--no-gather", "--json", str(out)])
    rows = json.loads(out.read_text())["selection"]
    assert [(row["path"], row["votes"]) for row in rows] == [
        ("fused", "group_mean"), ("composed", "group_mean"), ("fused", "head_max")]
    head_max = rows[-1]
    # the fused path only, without the rows that do not depend on the votes
    assert head_max["parts_ms"].keys() == {"query_votes", "collision_candidates", "rerank_select", "rest"}
    assert head_max["before"] == {} and head_max["methods"] == {}
    assert "900 x1 head_max / group_mean: whole selection" in capsys.readouterr().out


def test_quick_runs_the_fused_path_only(bench, tmp_path):
    out = tmp_path / "quick.json"
    bench.main(["--device", "cpu", "--contexts", "900", "--batches", "1", "--kv-heads", "2", "--q-heads", "4",
                "--head-dim", "32", "--budget", "160", "--update-buffer", "8", "--repeats", "1", "--quick",
                "--no-gather", "--json", str(out)])
    (fused,) = json.loads(out.read_text())["selection"]
    assert fused["path"] == "fused" and "old_rerank" not in fused["parts_ms"]
    assert fused["before"] == {}  # the before rows are the Triton kernels' (TRITON_INTERPRET=1 --smoke --quick)
