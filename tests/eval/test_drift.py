"""kvpolicy drift's meter on a tiny model: exact where the budget covers everything, and it tells
apart what a policy attends from what it leaves out."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import ConfigError
from kvpolicy.eval import decode as decoding
from kvpolicy.eval import drift

from conftest import build_model

PROMPT, NEW = 200, 60


@pytest.fixture(scope="module")
def shared():
    model = build_model("llama", max_position_embeddings=2048)
    ids = torch.randint(3, 128, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    continuation = torch.randint(3, 128, (NEW,), generator=torch.Generator().manual_seed(3)).tolist()
    return model, decoding.prefill(model, ids, torch.ones_like(ids)), continuation


def test_full_budget_recalls_everything(shared, single_thread):
    model, prefilled, continuation = shared
    units = {"name": "analytic", "update_buffer": 8}
    policy = kvpolicy.preset("pariskv", budget=512, local=16, prefill_units=units, decode_units=units)
    result = drift.measure_drift(model, prefilled, continuation, policy, window=20)
    assert [w["steps"] for w in result.windows] == [20, 20, 19]
    for w in result.windows:
        for metric in ("topk_recall", "prompt_recall", "mass_recall"):
            assert w[metric] == pytest.approx(1.0)
    # generated tokens leave the window of 16 from step 16 on, and are indexed 8 at a time
    assert result.windows[0]["generated_recall"] == pytest.approx(1.0)
    assert result.windows[-1]["generated_recall"] == pytest.approx(1.0)
    assert result.windows[-1]["generated_in_topk"] > 0


def test_a_window_policy_misses_the_generated_tokens_it_dropped(shared, single_thread):
    model, prefilled, continuation = shared
    policy = kvpolicy.preset("streaming", budget=24, sink=4)  # a window of 20 tokens
    result = drift.measure_drift(model, prefilled, continuation, policy, window=30)
    late = result.windows[-1]
    # from step 20 on generated tokens leave the window and are never attended again
    assert late["generated_in_topk"] > 0 and late["generated_recall"] == 0.0
    assert late["prompt_recall"] == 0.0
    assert 0.0 < late["topk_recall"] < 1.0 and 0.0 < late["mass_recall"] < 1.0


def test_stale_baseline_and_unknown_names():
    policy = drift.drift_policy("clusterkv-stale", 512)
    assert policy.name == "clusterkv-stale"
    assert policy.prefill_units.registered_name == "kmeans"
    assert policy.decode_units.registered_name == "nearest_centroid"
    with pytest.raises(ConfigError, match="unknown drift policy 'full'; known: streaming.*clusterkv-stale"):
        drift.drift_policy("full", 512)


def test_table_and_plot(tmp_path):
    windows = [{"first_step": 0, "steps": 10, "topk_recall": 0.9, "generated_recall": None, "prompt_recall": 0.8,
                "mass_recall": 0.95, "generated_in_topk": 0.0}]
    payload = {"length": 100, "budget": 64, "window": 10,
               "results": [{"policy": "pariskv", "describe": "", "seconds": 1.0, "windows": windows}]}
    assert drift.table(payload).splitlines()[-1] == "| 0-10 | 0.900 |"
    written = drift.save(payload, tmp_path / "d.json", tmp_path / "d.png")
    assert (tmp_path / "d.json").exists()
    pytest.importorskip("matplotlib")
    assert (tmp_path / "d.png").stat().st_size > 1000 and len(written) == 2


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    import builtins

    from kvpolicy.cli import main

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    # the model path does not exist: reaching the model load would fail with another message
    code = main(["drift", "--model", str(tmp_path / "no-model"), "--plot", str(tmp_path / "p.png")])
    assert code == 2
    assert "--plot needs matplotlib" in capsys.readouterr().err
