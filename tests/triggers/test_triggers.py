"""The built-in triggers' decisions on hand-made query sequences."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import kvpolicy

from kvpolicy.errors import ConfigError
from kvpolicy.triggers.query_cosine import QueryCosine

from conftest import prompt_query


def _unit(angle_degrees: float) -> torch.Tensor:
    """A (1, 1, 2) query at ``angle_degrees`` in the plane."""
    a = math.radians(angle_degrees)
    return torch.tensor([[[math.cos(a), math.sin(a)]]])


def _decisions(trigger: QueryCosine, angles: list[float]) -> list[bool]:
    state = trigger.init_state(1, 1, 2, torch.device("cpu"))
    return [bool(trigger.decide(_unit(a), state)) for a in angles]


def test_previous_never_fires_on_a_slow_drift_and_anchor_does():
    # 10 degrees per step: cos 0.985 between neighbours, below 0.9 after 26 degrees from the anchor
    angles = [10.0 * i for i in range(8)]
    assert _decisions(QueryCosine(tau=0.9, against="previous"), angles) == [True] + [False] * 7
    # anchor at 0 -> fires at 30 (cos 0.866), anchor 30 -> fires at 60, anchor 60 -> nothing by 70
    assert _decisions(QueryCosine(tau=0.9, against="anchor"), angles) == [
        True, False, False, True, False, False, True, False,
    ]


def test_both_fire_on_a_jump():
    angles = [0.0, 0.0, 90.0, 90.0]
    for against in ("previous", "anchor"):
        assert _decisions(QueryCosine(tau=0.5, against=against), angles) == [True, False, True, False]


def test_decision_is_per_sequence():
    trigger = QueryCosine(tau=0.9, against="anchor")
    state = trigger.init_state(2, 1, 2, torch.device("cpu"))
    trigger.decide(torch.cat([_unit(0), _unit(0)]), state)
    fired = trigger.decide(torch.cat([_unit(5), _unit(60)]), state)
    assert fired.tolist() == [False, True]


def test_unknown_reference_is_a_clear_error():
    with pytest.raises(ConfigError, match="against must be one of previous, anchor; got 'last'"):
        QueryCosine(tau=0.8, against="last").validate()


def test_an_every_step_layer_decides_without_asking_its_trigger(monkeypatch):
    """An always-reselecting trigger's decision is written at the prefill: the step never calls
    it, and every sequence still counts a re-selection at every step."""
    from kvpolicy.triggers.every_step import EveryStep

    from conftest import build_model, left_padded_batch

    assert EveryStep().decide(torch.zeros(3, 4, 8), None).tolist() == [True] * 3

    def asked(*args, **kwargs):
        raise AssertionError("the decode step asked an always-reselecting trigger")

    monkeypatch.setattr(EveryStep, "decide", asked)
    monkeypatch.setattr(EveryStep, "decide_and_note", asked)
    model = build_model("llama")
    ids, mask = left_padded_batch(200)
    policy = kvpolicy.preset("quest", budget=96)
    with torch.no_grad(), policy.apply(model) as session:
        model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    for state in session.cache.policy_layers():
        assert state.reselections.tolist() == [state.decode_steps] * ids.shape[0] == [5] * ids.shape[0]
        assert bool(state.reselect.all())
        # every decode slot is a boundary, none of the prompt's
        assert bool(state.boundary[:, 200:].all()) and not bool(state.boundary[:, :200].any())


def _prefilled(preset: str, **options):
    """A layer of ``preset`` (budget 96; 2 sequences, 2 KV heads of 4 query heads, dim 16) after a
    160-token random prompt, and the generator to draw its decode steps from."""
    import kvpolicy
    from kvpolicy.layer import PolicyLayerState

    state = PolicyLayerState(kvpolicy.preset(preset, budget=96, sink=4, local=16, **options), 0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    state.prefill(torch.randn(2, 2, 160, 16, generator=gen), torch.randn(2, 2, 160, 16, generator=gen),
                  torch.ones(2, 160, dtype=torch.bool), 4, last_query=prompt_query(2, 4, 16))
    return state, gen


@pytest.mark.parametrize("preset, expects_mask", [("quest", False), ("louiskv", True)])
def test_the_decode_step_passes_the_trigger_decision_unless_it_always_reselects(preset, expects_mask, monkeypatch):
    # every_step triggers declare always_reselects, so the selector gets no take mask (its
    # kernels may then rank however is fastest); other triggers pass their (B,) decision
    state, gen = _prefilled(preset)
    policy = state.policy
    assert policy.trigger.always_reselects is (not expects_mask)
    seen = []
    real_select = policy.selector.select

    def spy(*args, take=None, **kwargs):
        seen.append(take)
        return real_select(*args, take=take, **kwargs)

    monkeypatch.setattr(policy.selector, "select", spy)
    for _ in range(3):
        q, k, v = torch.randn(3, 2, 4, 16, generator=gen)
        state.decode(q, k[:, :2], v[:, :2], 0.25)
    assert len(seen) == 3
    if expects_mask:
        assert all(t is not None and t.dtype == torch.bool and t.shape == (2,) for t in seen)
        assert bool(seen[0].all())  # the first step always selects
    else:
        assert all(t is None for t in seen)


@pytest.mark.parametrize("preset, admit, launches", [("quest", "room", 0), ("quest", "evict", 3), ("louiskv", "room", 3)])
def test_an_always_reselecting_step_admits_with_no_launch_unless_it_evicts(preset, admit, launches, monkeypatch):
    # every row of an always-reselecting step re-selected after its fetch, so none may admit;
    # evicting still resets the buffer's kept rows to the new selection (through the admit op)
    state, gen = _prefilled(preset, admit=admit)
    policy = state.policy
    masks = []
    real_admit = state.store.admit

    def spy(evicted, reselected, ops, evict=False):
        masks.append(reselected.clone())
        return real_admit(evicted, reselected, ops, evict)

    monkeypatch.setattr(state.store, "admit", spy)
    for _ in range(3):
        q, k, v = torch.randn(3, 2, 4, 16, generator=gen)
        state.decode(q, k[:, :2], v[:, :2], 0.25)
    assert len(masks) == launches
    if policy.trigger.always_reselects:  # every row re-selected: none admits
        assert all(bool(m.all()) for m in masks)
    if admit == "evict":  # the kept rows are the last selection's
        assert bool((state.store.kept == state.store.retrieved.fill).all())


@pytest.mark.parametrize("preset, trigger, per_step", [
    ("quest", None, []),  # every step: decided at the prefill, no launch
    ("louiskv", {"name": "interval", "n": 3}, ["interval_decision"]),  # fire and note in one op
    ("louiskv", {"name": "score_gap", "measure": "mass", "leaving": "ignored"}, ["score_gap_fire"]),  # notes too
    ("louiskv", {"name": "query_cosine", "tau": 0.9}, ["query_cosine_fire", "note_decision"]),  # a fire op, a note
])
def test_a_step_writes_its_decision_in_the_fewest_ops(preset, trigger, per_step, monkeypatch):
    """The bound decision ops a decode step calls: none for an always-reselecting trigger, one where
    a trigger's own op writes the decision, a fire op and ``note_decision`` otherwise."""
    # the first step's selection forced: every decision path notes at least one re-selection
    options = {} if trigger is None else {"trigger": trigger, "first_selection": "first_step"}
    state, gen = _prefilled(preset, **options)
    calls = []
    ops = copy.copy(state.ops)
    for name in ("note_decision", "interval_fire", "interval_decision", "score_gap_fire", "query_cosine_fire"):
        real = getattr(ops, name)
        setattr(ops, name, lambda *args, _real=real, _name=name, **kwargs: (calls.append(_name), _real(*args, **kwargs))[1])
    state.ops = ops
    for _ in range(3):
        q, k, v = torch.randn(3, 2, 4, 16, generator=gen)
        state.decode(q, k[:, :2], v[:, :2], 0.25)
    assert calls == per_step * 3
    assert int(state.reselections.min()) >= 1
