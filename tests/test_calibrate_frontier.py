"""``kvpolicy calibrate`` reports and stores the whole frontier: every candidate tau's re-selection
share and agreement, the every-step reference beside them, and the rule's verdicts."""

from __future__ import annotations

import json

import pytest

from kvpolicy import cli
from kvpolicy.eval.calibrate import TauMeasurements, choose, frontier, frontier_table, merge, store


def _measured(sample_ids=(0, 1), every_step=True) -> TauMeasurements:
    # tau 0.6 cheap and poor; 0.8 dearer and no better (dominated); 0.9 within 2 points of 0.95, the best
    taus = [0.6, 0.8, 0.9, 0.95]
    share = {"0.6": [0.1, 0.1], "0.8": [0.3, 0.3], "0.9": [0.6, 0.6], "0.95": [0.9, 0.9]}
    top1 = {"0.6": [0.70, 0.70], "0.8": [0.70, 0.70], "0.9": [0.95, 0.95], "0.95": [0.96, 0.96]}
    kl = {t: [0.1, 0.1] for t in share}
    n = len(sample_ids)
    return TauMeasurements("m", 1024, 16, 256, taus, list(sample_ids), {k: v[:n] for k, v in share.items()},
                           {k: v[:n] for k, v in top1.items()}, {k: v[:n] for k, v in kl.items()}, "previous",
                           [0.97] * n if every_step else [], [0.01] * n if every_step else [])


def test_frontier_marks_every_candidate_and_the_every_step_reference() -> None:
    measured = _measured()
    rows = frontier(measured, 0.02)
    assert [r.tau for r in rows] == [0.6, 0.8, 0.9, 0.95, None]
    by = {r.tau: r for r in rows}
    assert choose(measured.points(), 0.02) == 0.9
    assert [t for t, r in by.items() if r.chosen] == [0.9]
    assert [t for t, r in by.items() if r.within_tolerance] == [0.9, 0.95, None]
    # 0.8 re-selects more than 0.6 and agrees no better: off the frontier; the rest are on it
    assert [t for t, r in by.items() if not r.pareto] == [0.8]
    assert by[None].reselect_share == 1.0 and by[None].top1_agreement == pytest.approx(0.97)

    table = frontier_table(measured, 0.02)
    lines = table.splitlines()
    assert len(lines) == 1 + 5 + 1
    assert "0.90" in lines[3] and "<- chosen" in lines[3] and "-2.0 pt" in lines[3]
    assert lines[5].split()[:2] == ["every", "step"] and "100.0%" in lines[5]
    assert lines[-1].startswith("rule: the candidate tau with the fewest re-selections") and "2 points" in lines[-1]


def test_store_keeps_the_whole_frontier_and_the_rule(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    measured = _measured()
    store(measured, 0.9, 0.02)
    entry = json.loads((tmp_path / "calibration.json").read_text())["m"]
    assert entry["tau"] == 0.9 and "within 2 points" in entry["rule"]
    assert [p["tau"] for p in entry["points"]] == [0.6, 0.8, 0.9, 0.95]
    assert {k for k in entry["points"][0]} >= {"reselect_share", "top1_agreement", "kl_mean", "pareto", "chosen"}
    assert entry["every_step"]["top1_agreement"] == pytest.approx(0.97)


def test_merge_keeps_the_reference_only_if_every_shard_has_it() -> None:
    both = merge([_measured([0]), _measured([1])])
    assert both.every_step() is not None and len(both.every_step_top1) == 2
    old = merge([_measured([0]), _measured([1], every_step=False)])  # a shard from before the reference
    assert old.every_step() is None
    assert [r.tau for r in frontier(old)] == [0.6, 0.8, 0.9, 0.95]
    assert "vs every step" in frontier_table(old) and " - " in frontier_table(old).splitlines()[1]


def test_cli_merge_prints_the_frontier(tmp_path, monkeypatch, capsys) -> None:
    from dataclasses import asdict

    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    shards = []
    for i in (0, 1):
        path = tmp_path / f"s{i}.json"
        path.write_text(json.dumps(asdict(_measured([i]))))
        shards.append(str(path))
    assert cli.main(["calibrate", "--merge", *shards]) == 0
    out = capsys.readouterr().out
    assert "every step" in out and "<- chosen" in out and out.count("frontier") >= 3 and "rule:" in out
    assert "stored tau=0.9" in out
