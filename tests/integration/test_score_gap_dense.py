"""The score-gap trigger under the anchor test: with a budget covering the whole context it holds
every unit (the selection takes them all, and each token that leaves the local window is admitted
and its decode unit held), so it selects once (from the prompt's last query, or on the forced first
step), keeps that selection on every later step, and reproduces dense attention."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from reuse_check import checking_reuse
from test_dense_equivalence import (  # noqa: F401  (``reference`` is a fixture)
    BUDGET, FAMILIES, NEW_TOKENS, assert_close, check_policy_ran, generate, reference,
)

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("first_selection, step_selections", [("prompt", 0), ("first_step", 1)])
@pytest.mark.parametrize("measure, margin", [("mass", -3.0), ("weakest", 0.0)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_score_gap_selects_once_and_matches_dense(reference, family, measure, margin, first_selection,
                                                  step_selections):
    model, ids, mask, plain, _ = reference(family)
    policy = kvpolicy.preset("louiskv", budget=BUDGET, first_selection=first_selection,
                             trigger={"name": "score_gap", "measure": measure, "margin": margin})
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        out = generate(model, ids, mask)
    check_policy_ran(session, policy, NEW_TOKENS - 1)
    for state in session.cache.policy_layers():
        assert state.reselections.tolist() == [step_selections] * len(state.reselections)
    assert reuse.reusing > 0 and reuse.admitted > 0, reuse
    for step, (got, want) in enumerate(zip(out.scores, plain.scores)):
        assert_close(got, want, f"decode step {step} scores")
    assert torch.equal(out.sequences, plain.sequences)
