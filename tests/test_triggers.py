"""The built-in triggers' decisions on hand-made query sequences."""

from __future__ import annotations

import math

import pytest
import torch

from kvpolicy.errors import ConfigError
from kvpolicy.triggers.query_cosine import QueryCosine


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
