"""``kvpolicy calibrate`` reports and stores the whole frontier: every candidate setting's re-selection
share and agreement, the every-step reference beside them, and the rule's verdicts; the rule holds
candidates to every-step selection with the same units, and its choice is the louiskv preset's default."""

from __future__ import annotations

import json

import pytest

import kvpolicy
from kvpolicy import cli
from kvpolicy.eval.calibrate import TauMeasurements, choose, choose_for, frontier, frontier_table, merge, store
from kvpolicy.triggers import QueryCosine, ScoreGap


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
    assert lines[-1].startswith("rule: the query_cosine setting with the fewest re-selections") and "2 points" in lines[-1]
    assert "of every-step selection's with the same units (97.0%)" in lines[-1]


def test_store_keeps_the_whole_frontier_and_the_rule(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    measured = _measured()
    store(measured, 0.9, 0.02)
    entry = json.loads((tmp_path / "calibration.json").read_text())["m"]
    record = entry["query_cosine"]
    assert entry["tau"] == 0.9 and record["tau"] == 0.9 and "within 2 points" in record["rule"]
    assert [p["tau"] for p in record["points"]] == [0.6, 0.8, 0.9, 0.95]
    assert {k for k in record["points"][0]} >= {"reselect_share", "top1_agreement", "kl_mean", "pareto", "chosen"}
    assert record["every_step"]["top1_agreement"] == pytest.approx(0.97)
    assert "trigger" not in entry  # the paper's tau does not replace the preset's trigger


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
    # two prompts of 16 steps are too few for the rule (below): accepted here by --min-tokens
    assert cli.main(["calibrate", "--merge", *shards, "--min-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "every step" in out and "<- chosen" in out and out.count("frontier") >= 3 and "rule:" in out
    assert "stored query_cosine tau=0.9" in out


def test_too_few_tokens_print_the_frontier_but_store_nothing(tmp_path, monkeypatch, capsys) -> None:
    from dataclasses import asdict

    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    path = tmp_path / "s.json"
    path.write_text(json.dumps(asdict(_measured([0, 1]))))  # 2 prompts x 16 steps: 3.1 points a token
    assert cli.main(["calibrate", "--merge", str(path)]) == 2
    out, err = capsys.readouterr()
    assert "<- chosen" in out  # the figures are shown all the same
    assert "not stored: calibrate measured 32 tokens (2 prompts x 16 steps)" in err and "at least 200 tokens" in err
    assert not (tmp_path / "calibration.json").exists()
    assert cli.main(["calibrate", "--merge", str(path), "--min-tokens", "33"]) == 2
    assert "at least 33 tokens" in capsys.readouterr().err
    assert cli.main(["calibrate", "--merge", str(path), "--min-tokens", "32"]) == 0
    assert (tmp_path / "calibration.json").exists()


def _margins(shares, top1, every=0.97) -> TauMeasurements:
    margins = sorted(shares)
    return TauMeasurements("m", 1024, 16, 256, margins, [0], {str(m): [shares[m]] for m in margins},
                           {str(m): [top1[m]] for m in margins}, {str(m): [0.1] for m in margins}, "previous",
                           [every], [0.01], trigger="score_gap", options={"measure": "mass"})


def test_the_rule_holds_candidates_to_every_step_selection_not_to_the_best_candidate() -> None:
    # best candidate 0.96; every step 0.97: within 2 points of every step is >= 0.95, so -3 (0.945,
    # the cheapest within 2 points of the best candidate) is out and -2 is chosen
    measured = _margins({-3.0: 0.10, -2.0: 0.30, -1.0: 0.60}, {-3.0: 0.945, -2.0: 0.955, -1.0: 0.96})
    assert choose_for(measured) == -2.0
    assert [r.tau for r in frontier(measured) if r.chosen] == [-2.0]
    assert "margin" in frontier_table(measured).splitlines()[0]
    # without the every-step row the best candidate is the reference (and the table says so)
    measured.every_step_top1, measured.every_step_kl = [], []
    assert choose_for(measured) == -3.0
    assert "no every-step row" in frontier_table(measured)


def test_ties_go_to_the_more_eager_setting_and_none_within_takes_the_best() -> None:
    # equal shares and agreement: the lower margin (score_gap) / higher tau (query_cosine) is more eager
    tied = _margins({-3.0: 0.2, -2.0: 0.2}, {-3.0: 0.96, -2.0: 0.96})
    assert choose_for(tied) == -3.0
    points = tied.points()
    assert choose(points, 0.02, 0.97, higher_is_eager=True) == -2.0
    # nothing within 2 points of every step (0.97): the best-agreeing setting, however dear
    far = _margins({-3.0: 0.1, -1.0: 0.5}, {-3.0: 0.80, -1.0: 0.90})
    assert choose_for(far) == -1.0


def test_a_score_gap_calibration_becomes_the_louiskv_default_and_the_papers_trigger_stays_by_name(
        tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    store(_measured(), 0.9, 0.02)  # the paper's trigger: tau 0.9
    measured = _margins({-3.0: 0.10, -2.0: 0.30}, {-3.0: 0.96, -2.0: 0.97})
    store(measured, choose_for(measured), 0.02)
    entry = json.loads((tmp_path / "calibration.json").read_text())["m"]
    assert entry["trigger"] == {"name": "score_gap", "measure": "mass", "margin": -3.0}
    assert entry["tau"] == 0.9 and entry["score_gap"]["margin"] == -3.0
    trigger = kvpolicy.preset("louiskv", model="m").trigger
    assert isinstance(trigger, ScoreGap) and trigger.margin == -3.0 and trigger.measure == "mass"
    paper = kvpolicy.preset("louiskv", model="m", trigger="query_cosine").trigger
    assert isinstance(paper, QueryCosine) and paper.tau == 0.9


def test_the_embedded_models_default_is_the_best_trigger_and_the_papers_keeps_its_tau(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))  # no user calibration file
    from kvpolicy.calibration import BUILTIN_TAU
    from kvpolicy.presets import BUILTIN_TRIGGER

    trigger = kvpolicy.preset("louiskv", model="smollm2").trigger
    assert isinstance(trigger, ScoreGap)
    builtin = dict(BUILTIN_TRIGGER["smollm2-135m-instruct"])
    assert builtin.pop("name") == "score_gap" and trigger == ScoreGap(**builtin)
    paper = kvpolicy.preset("louiskv", model="smollm2", trigger="query_cosine").trigger
    assert isinstance(paper, QueryCosine) and paper.tau == BUILTIN_TAU["smollm2-135m-instruct"]
    # Gemma 3 by its CLI name or its id: its own calibration's choice, the same form
    for name in ("gemma3", "gemma-3-270m"):
        gemma = dict(BUILTIN_TRIGGER["gemma-3-270m"])
        assert gemma.pop("name") == "score_gap"
        assert kvpolicy.preset("louiskv", model=name).trigger == ScoreGap(**gemma)
    # a model nobody calibrated keeps the paper's trigger at its published tau
    unknown = kvpolicy.preset("louiskv", model="some-other-model").trigger
    assert isinstance(unknown, QueryCosine) and unknown.tau == 0.7
