"""The score-gap trigger on a layer whose pages point in known directions.

Page ``p`` of the prompt holds keys along the basis vector ``e_p``; the retrieval budget holds two
pages. A query along ``e_j`` scores page ``j`` high and every other page near zero, so what the
trigger must do is known exactly: keep the selection while the query points at a held page, fire
at the first step it points at an unheld one.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import kvpolicy
from kvpolicy.errors import ConfigError
from kvpolicy.layer import PolicyLayerState
from kvpolicy.triggers.score_gap import ScoreGap

from gpu_cross import cross
from host_reads import no_host_reads
from test_graph_ready import _host_state, _restore, _tensors

HQ, H, D, PAGE, PAGES, LOCAL = 2, 1, 16, 16, 10, 16
PROMPT = PAGE * PAGES + LOCAL
RUNNER_UP, FILLER = 9, 12


def _layer(trigger: dict, batch: int = 1, seed: int = 0, admit: str = "room", backend: str = "auto",
           device: torch.device = torch.device("cpu"), spikes: tuple = ()) -> PolicyLayerState:
    gen = torch.Generator().manual_seed(seed)
    policy = kvpolicy.Policy(trigger=trigger, prefill_units={"name": "pages", "size": PAGE},
                             decode_units={"name": "pages", "size": PAGE}, selector="top_budget",
                             budget=4 + LOCAL + 2 * PAGE, sink=4, local=LOCAL, admit=admit, backend=backend)
    keys = 0.01 * torch.randn(batch, H, PROMPT, D, generator=gen)
    for page in range(PAGES):
        keys[:, :, page * PAGE:(page + 1) * PAGE, page] += 3.0
    keys[:, :, RUNNER_UP * PAGE:(RUNNER_UP + 1) * PAGE, FILLER] += 1.0
    for token, dim, size in spikes:  # (token, dimension, value): one key that stands out of its page
        keys[:, :, token, dim] += size
    values = torch.randn(batch, H, PROMPT, D, generator=gen)
    state = PolicyLayerState(policy, 0, device)
    state.prefill(keys.to(device), values.to(device), torch.ones(batch, PROMPT, dtype=torch.bool, device=device), HQ)
    return state


def _toward(page: int, batch: int = 1) -> torch.Tensor:
    q = torch.zeros(batch, HQ, D)
    q[..., page] = 5.0
    q[..., FILLER] = 1.0  # page RUNNER_UP is every query's second best, so the two held pages are known
    return q


def _step(state: PolicyLayerState, query: torch.Tensor) -> bool:
    batch = query.shape[0]
    noise = torch.Generator().manual_seed(state.decode_steps)
    k, v = 0.01 * torch.randn(2, batch, H, D, generator=noise)
    before = state.reselections.clone()
    state.decode(query, k.to(query.device), v.to(query.device), D**-0.5)
    return bool((state.reselections - before)[0])


def _attended_pages(state: PolicyLayerState) -> set[int]:
    slots = state.store.retrieved.slots[0, 0][state.store.retrieved.valid[0, 0]]
    return {int(s) // PAGE for s in slots if int(s) < PAGE * PAGES}


@pytest.mark.parametrize("measure, margin", [("weakest", 1.0), ("mass", -1.0), ("rank", 0.5)])
def test_fires_when_the_query_needs_an_unheld_page_and_only_then(measure, margin):
    state = _layer({"name": "score_gap", "margin": margin, "measure": measure})
    pages = [2, 2, 2, 7, 7, 7, 2, 2]
    fired = []
    for page in pages:
        fired.append(_step(state, _toward(page)))
        assert page in _attended_pages(state), f"step {len(fired)}: page {page} not attended"
    assert fired == [True, False, False, True, False, False, True, False]


def test_a_large_margin_keeps_the_first_selection():
    state = _layer({"name": "score_gap", "margin": 50.0})
    fired = [_step(state, _toward(page)) for page in (2, 2, 7, 7)]
    assert fired == [True, False, False, False]
    assert 7 not in _attended_pages(state)


def test_a_slow_turn_fires_against_the_held_selection_not_the_last_query():
    # the query turns from e_2 to e_7 by 9 degrees a step: never far from the last query, but
    # page 7 was never selected, so it must fire once page 7 outscores the held pages by the margin
    state = _layer({"name": "score_gap", "margin": 1.0})
    fired = []
    for i in range(11):
        a = math.radians(9.0 * i)
        q = _toward(2)
        q[..., 2], q[..., 7] = 5.0 * math.cos(a), 5.0 * math.sin(a)
        fired.append(_step(state, q))
    assert fired[0] and any(fired[1:])
    # page 7 scores 0.25 * 15 * sin(a) over the weakest held page's 0.25: above that by 1.0 from 27 degrees on
    assert fired.index(True, 1) == 3
    assert 7 in _attended_pages(state)


def _unit_slots(state: PolicyLayerState, unit: int) -> set[int]:
    start, size, order = state.units.start[0, 0], state.units.size[0, 0], state.units.order[0, 0]
    return {int(order[p]) for p in range(int(start[unit]), int(start[unit] + size[unit]))}


def _check_held_is_what_is_attended(state: PolicyLayerState) -> None:
    """Every unit the trigger holds has a token in the retrieved buffer, and every unit all of whose
    tokens are there is held (the selection's last unit may be cut to the budget: held, partly), as
    the next step's decision sees them (it first follows the token that left the window last step)."""
    trigger = state.policy.trigger
    trigger._follow_leaving_token(state.trigger_state)  # what the next decide does first; idempotent
    held = trigger.held_mask(state.trigger_state)[0, 0]
    retrieved = {int(s) for s in state.store.retrieved.slots[0, 0][state.store.retrieved.valid[0, 0]]}
    selectable = state.units.selectable[0, 0]
    for unit in range(state.units.capacity):
        slots = _unit_slots(state, unit) if bool(selectable[unit]) else set()
        if bool(held[unit]):
            assert slots & retrieved, f"step {state.decode_steps}: unit {unit} held, none of its tokens attended"
        elif slots:
            assert not slots <= retrieved, f"step {state.decode_steps}: unit {unit} attended whole, not held"


def test_the_held_units_are_the_selection_in_use():
    state = _layer({"name": "score_gap", "margin": 1.0})
    for page in (3, 3, 8, 8, 8):
        _step(state, _toward(page))
        _check_held_is_what_is_attended(state)
    held = state.policy.trigger.held_mask(state.trigger_state)[0, 0]
    assert set(held.nonzero().flatten().tolist()) == {8, RUNNER_UP}


@pytest.mark.parametrize("measure, margin", [("weakest", 1.0), ("mass", -1.0)])
def test_decode_tokens_dropped_from_a_full_buffer_are_not_held(measure, margin):
    # the selection fills the buffer (pages 2 and 9), so the tokens that leave the local window
    # later are not attended; their keys point where the query does, so their decode page is
    # what the selector would take now: the trigger must see it as unheld and fire, and the
    # re-selection must then attend it
    state = _layer({"name": "score_gap", "margin": margin, "measure": measure})
    query = _toward(2)
    fired = []
    for step in range(LOCAL + PAGE):
        key = 0.01 * torch.randn(1, H, D, generator=torch.Generator().manual_seed(step))
        key[..., 2] += 3.0
        before = state.reselections.clone()
        state.decode(query, key, torch.randn(1, H, D), D**-0.5)
        fired.append(bool((state.reselections - before)[0]))
        _check_held_is_what_is_attended(state)
    # the prompt's last LOCAL tokens (noise keys) leave first; the decoded keys from step LOCAL + 1 on
    assert fired[0] and not any(fired[1:LOCAL + 1])
    assert any(fired[LOCAL + 1:]), "the decoded keys outscored the held pages and were never fetched"
    left = set(range(PROMPT, PROMPT + PAGE - 1))  # decoded tokens that have left the local window
    retrieved = {int(s) for s in state.store.retrieved.slots[0, 0][state.store.retrieved.valid[0, 0]]}
    assert left & retrieved


def test_decode_tokens_admitted_while_the_buffer_has_room_are_held():
    # a budget past the context: every token that leaves the local window is admitted, so the trigger
    # holds every unit and never fires after the first step
    gen = torch.Generator().manual_seed(0)
    policy = kvpolicy.Policy(trigger={"name": "score_gap", "margin": -5.0, "measure": "mass"},
                             prefill_units={"name": "pages", "size": PAGE}, decode_units={"name": "pages", "size": 4},
                             selector="top_budget", budget=4 + LOCAL + PROMPT + 64, sink=4, local=LOCAL)
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    state.prefill(torch.randn(1, H, PROMPT, D, generator=gen), torch.randn(1, H, PROMPT, D, generator=gen),
                  torch.ones(1, PROMPT, dtype=torch.bool), HQ)
    for step in range(LOCAL + 24):
        q, k, v = torch.randn(1, HQ, D, generator=gen), torch.randn(1, H, D, generator=gen), torch.randn(1, H, D, generator=gen)
        state.decode(q, k, v, D**-0.5)
        _check_held_is_what_is_attended(state)
    assert int(state.reselections[0]) == 1
    held = state.policy.trigger.held_mask(state.trigger_state)[0, 0]
    assert bool(held[state.units.num_prompt_units:state.units.num_prompt_units + 6].all())  # 24 tokens, pages of 4


def test_the_decision_is_per_sequence():
    state = _layer({"name": "score_gap", "margin": 1.0}, batch=2)
    state.decode(_toward(4, 2), torch.zeros(2, H, D), torch.zeros(2, H, D), D**-0.5)
    before = state.reselections.clone()
    q = torch.cat([_toward(4), _toward(6)])
    state.decode(q, torch.zeros(2, H, D), torch.zeros(2, H, D), D**-0.5)
    assert (state.reselections - before).tolist() == [0, 1]


@pytest.mark.parametrize("admit, trigger", [
    ("room", {"name": "score_gap", "margin": 0.5}),
    ("evict", {"name": "score_gap", "margin": 0.5}),
    ("room", {"name": "score_gap", "margin": 0.5, "measure": "rank", "leaving": "ignored", "cap": 6}),
    # its outlier keys are taken at prefill: the step reads no host state
    ("room", {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored", "estimate": "outlier",
              "outliers": 4, "group": "each"}),
    ("room", {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored", "estimate": "outlier",
              "outliers": 4, "group": "each", "every": 2}),  # which steps measure is counted on the device
    # the first pass's key basis is taken at prefill too
    ("room", {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored", "estimate": "outlier",
              "group": "each", "low_rank": 4, "low_rank_top": 2}),
])
def test_the_step_replays_with_frozen_host_state(admit, trigger):
    steps = 30
    eager, replayed = (_layer(trigger, batch=2, seed=1, admit=admit) for _ in range(2))
    eager.plan.reserve(steps)
    replayed.plan.reserve(steps)
    captured = _tensors(replayed)
    pointers = {k: t.data_ptr() for k, t in captured.items()}
    host = _host_state(replayed)
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        q = _toward(step // 4 % PAGES, 2) + torch.randn(2, HQ, D, generator=gen)
        k, v = 0.01 * torch.randn(2, 2, H, D, generator=gen)
        want = eager.decode(q, k, v, D**-0.5)
        _restore(replayed, host)
        with no_host_reads("score_gap's decode step"):
            got = replayed.decode(q, k, v, D**-0.5)
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"step {step} differs under replay")
    now = _tensors(replayed)
    moved = [k for k, t in captured.items() if now[k] is not t or now[k].data_ptr() != pointers[k]]
    assert not moved, f"state tensors rebound during decode: {moved}"
    # not vacuous: it both re-selected and reused
    assert torch.equal(eager.reselections, replayed.reselections)
    assert (1 < replayed.reselections).all() and (replayed.reselections < steps).all()


_FUSED_TRIGGERS = {
    "weakest": {"name": "score_gap", "margin": 0.5},
    "mass": {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored"},  # the louiskv preset's kind
    "rank-cap": {"name": "score_gap", "margin": 0.5, "measure": "rank", "leaving": "ignored", "cap": 5},
    # the op that scores the outlier keys itself (ops.score_gap_outlier_fire)
    "outlier": {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored", "estimate": "outlier",
                "outliers": 2, "group": "each"},
    "outlier-every-2": {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored",
                        "estimate": "outlier", "outliers": 2, "group": "each", "every": 2},
    "outlier-challengers": {"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored",
                            "estimate": "outlier", "outliers": 2, "group": "each", "every": 3, "challengers": 2},
}


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton step needs a CUDA device or TRITON_INTERPRET=1")
# On the CPU (gpu_cross) each trigger with one admit rule, and where the fused op branches on the rule for that
# trigger, with the pair it branches on: leaving="unheld" with "evict" (the follow launch drops and evicts),
# measure "rank" with "evict" (the held mean over the list it evicted), challengers with "evict" (checked
# against the marks it dropped), and the outlier op at every step with both (with "room" the blocks launch does
# the follow launch's work, with "evict" the follow launch runs); the whole cross product on the GPU
@pytest.mark.parametrize("trigger, admit", cross(_FUSED_TRIGGERS, ["room", "evict"],
                                                  on_cpu=[(0, 1), (1, 0), (2, 1), (3, 0), (3, 1), (4, 1), (5, 1)]))
def test_the_fused_step_decides_as_the_reference(trigger, admit):
    # the layer's decode through the Triton op (ops.score_gap_fire) against the reference trigger:
    # the same decisions, held lists and outputs over a decode whose query wanders across pages
    # (on a GPU when there is one: the attention kernels then differ in rounding, not the decisions)
    steps = 30
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reference, fused = (_layer(trigger, batch=2, seed=1, admit=admit, backend=backend, device=device)
                        for backend in ("reference", "triton"))
    gen = torch.Generator().manual_seed(5)
    for step in range(steps):
        q = _toward(step // 4 % PAGES, 2) + torch.randn(2, HQ, D, generator=gen)
        k, v = 0.01 * torch.randn(2, 2, H, D, generator=gen)
        q, k, v = q.to(device), k.to(device), v.to(device)
        want = reference.decode(q, k, v, D**-0.5)
        got = fused.decode(q, k, v, D**-0.5)
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3, msg=f"step {step}: outputs differ")
        assert torch.equal(fused.reselections, reference.reselections), f"step {step}: decisions differ"
        assert torch.equal(fused.trigger_state.held, reference.trigger_state.held), f"step {step}: held differs"
    assert (1 < fused.reselections).all() and (fused.reselections < steps).all()  # it reused and re-selected


def test_options_are_checked():
    with pytest.raises(ConfigError, match="margin must be a number"):
        ScoreGap(margin="big").validate()
    with pytest.raises(ConfigError, match="measure must be one of weakest, mass"):
        ScoreGap(measure="max").validate()
    state = PolicyLayerState(kvpolicy.preset("pariskv", budget=96, sink=4, local=16,
                                             trigger={"name": "score_gap"}), 0, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ConfigError, match="needs a selector that scores a unit table"):
        state.prefill(torch.randn(1, 2, 200, 16, generator=gen), torch.randn(1, 2, 200, 16, generator=gen),
                      torch.ones(1, 200, dtype=torch.bool), 4)


def _two_layers(trigger: dict) -> list[PolicyLayerState]:
    """Layers 0 and 1 of one policy (one trigger), prefilled in order as a model's forward does."""
    gen = torch.Generator().manual_seed(0)
    policy = kvpolicy.Policy(trigger=trigger, prefill_units={"name": "pages", "size": PAGE},
                             decode_units={"name": "pages", "size": PAGE}, selector="top_budget",
                             budget=4 + LOCAL + 2 * PAGE, sink=4, local=LOCAL)
    keys = 0.01 * torch.randn(1, H, PROMPT, D, generator=gen)
    for page in range(PAGES):
        keys[:, :, page * PAGE:(page + 1) * PAGE, page] += 3.0
    keys[:, :, RUNNER_UP * PAGE:(RUNNER_UP + 1) * PAGE, FILLER] += 1.0
    layers = []
    for index in range(2):
        state = PolicyLayerState(policy, index, torch.device("cpu"))
        state.prefill(keys, torch.randn(1, H, PROMPT, D, generator=gen), torch.ones(1, PROMPT, dtype=torch.bool), HQ)
        layers.append(state)
    return layers


@pytest.mark.parametrize("follow, expect_follows", [(0.0, False), (0.5, False), (2.0, True), (float("inf"), True)])
def test_follow_lowers_the_margin_where_the_layer_above_reselected(follow, expect_follows):
    # layer 0's query turns to page 7 at step 3 (it fires there). Layer 1's stays on page 2 with a
    # little of page 7: 0.25 * 3 * 2.5 over the held pages 2 and 9 puts its mass gap at
    # 1.875 - 3.75 - log(1 + e**-3.5) = -1.91, under the margin -1 but over -1 - 2
    top, below = _two_layers({"name": "score_gap", "margin": -1.0, "measure": "mass", "follow": follow})
    assert below.trigger_state.above == top and top.trigger_state.above is None
    leaning = _toward(2)
    leaning[..., 7] = 2.5
    fired, gaps = [], []
    for step, page in enumerate((2, 2, 7, 7)):
        steps = []
        # layer 1's first selection is made on page 2 alone, so it holds pages 2 and 9
        for state, q in ((top, _toward(page)), (below, leaning if step else _toward(2))):
            before = state.reselections.clone()
            state.decode(q, torch.zeros(1, H, D), torch.zeros(1, H, D), D**-0.5)
            steps.append(bool((state.reselections - before)[0]))
        fired.append(steps)
        gaps.append(float(below.trigger_state.gap[0]))
    assert abs(gaps[1] + 1.91) < 0.02, gaps
    assert [f[0] for f in fired] == [True, False, True, False]
    assert [f[1] for f in fired] == [True, False, expect_follows, False]


def test_leaving_ignored_keeps_the_selection_whatever_left_the_window():
    # the case of test_decode_tokens_dropped_from_a_full_buffer_are_not_held, with leaving="ignored":
    # the decoded keys leave into a unit opened after the selection, which may not fire
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "leaving": "ignored"})
    fired = []
    for step in range(LOCAL + PAGE):
        key = 0.01 * torch.randn(1, H, D, generator=torch.Generator().manual_seed(step))
        key[..., 2] += 3.0
        before = state.reselections.clone()
        state.decode(_toward(2), key, torch.randn(1, H, D), D**-0.5)
        fired.append(bool((state.reselections - before)[0]))
    assert fired == [True] + [False] * (LOCAL + PAGE - 1)
    retrieved = {int(s) for s in state.store.retrieved.slots[0, 0][state.store.retrieved.valid[0, 0]]}
    assert not set(range(PROMPT, PROMPT + PAGE)) & retrieved
    with pytest.raises(ConfigError, match="leaving must be one of unheld, ignored"):
        ScoreGap(leaving="dropped").validate()


@pytest.mark.parametrize("admit", ["room", "evict"])
def test_admit_evict_keeps_the_prompts_last_tokens_in_place_of_the_lowest_ranked_page(admit):
    # the selection (pages 2, then RUNNER_UP: score order) fills the buffer; the prompt's last LOCAL
    # tokens then leave the local window while the query stays on page 2, so nothing fires. With
    # admit="evict" they replace RUNNER_UP's rows (the lowest-ranked), page 2 stays, and the trigger
    # holds what is attended: the leaving tokens' decode page, not RUNNER_UP; with "room" they are lost
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass"}, admit=admit)
    fired = []
    for _ in range(LOCAL + 1):
        fired.append(_step(state, _toward(2)))
        _check_held_is_what_is_attended(state)
    assert fired[0] and not any(fired[1:])
    retrieved = {int(s) for s in state.store.retrieved.slots[0, 0][state.store.retrieved.valid[0, 0]]}
    # the token that left at the first step was a candidate of that step's selection, not admitted
    leaving = set(range(PROMPT - LOCAL + 1, PROMPT + 1))
    assert _unit_slots(state, 2) <= retrieved
    held = set(state.policy.trigger.held_mask(state.trigger_state)[0, 0].nonzero().flatten().tolist())
    if admit == "evict":
        assert leaving <= retrieved and not _unit_slots(state, RUNNER_UP) & retrieved
        assert RUNNER_UP not in held and 2 in held and int(state.store.kept[0, 0]) == PAGE
    else:
        assert not leaving & retrieved and _unit_slots(state, RUNNER_UP) <= retrieved
        assert held == {2, RUNNER_UP}


def test_a_dropped_layer_frees_its_state_without_the_garbage_collector():
    # the trigger's state points back at its layer: a strong reference would make a cycle that
    # keeps the layer's KV alive until a collection runs (bench e2e's next row ran out of memory)
    import gc
    import weakref

    state = _layer({"name": "score_gap", "margin": 1.0})
    _step(state, _toward(2))
    gone = weakref.ref(state)
    gc.disable()
    try:
        del state
        assert gone() is None, "the layer state outlived its last reference (a reference cycle)"
    finally:
        gc.enable()


def test_rank_counts_the_unheld_pages_above_the_held_mean():
    # held: the query's page and the runner-up; turning to page 7 puts one unheld page above their mean
    state = _layer({"name": "score_gap", "margin": 0.5, "measure": "rank"})
    assert _step(state, _toward(2))
    assert not _step(state, _toward(2))
    assert float(state.trigger_state.gap[0]) == 0.0
    assert _step(state, _toward(7))
    assert float(state.trigger_state.gap[0]) == 1.0
    assert 7 in _attended_pages(state)


def test_cap_reselects_a_selection_kept_cap_steps():
    state = _layer({"name": "score_gap", "margin": 50.0, "cap": 3})
    fired = [_step(state, _toward(2)) for _ in range(8)]
    assert fired == [True, False, False, True, False, False, True, False]
    # a re-selection for the gap restarts the count
    state = _layer({"name": "score_gap", "margin": 1.0, "cap": 3})
    fired = [_step(state, _toward(page)) for page in (2, 2, 7, 7, 7, 7)]
    assert fired == [True, False, True, False, False, True]


def test_margins_set_a_margin_per_layer():
    first, second = _two_layers({"name": "score_gap", "margin": 50.0, "margins": [50.0, -50.0]})
    assert first.policy.trigger.margin_of(0) == 50.0 and first.policy.trigger.margin_of(1) == -50.0
    assert first.policy.trigger.margin_of(5) == 50.0  # past the list: margin
    fired = [(_step(first, _toward(page)), _step(second, _toward(page))) for page in (2, 2, 7)]
    assert fired == [(True, True), (False, True), (False, True)]


@pytest.mark.parametrize("estimate", [{}, {"measure": "mass", "estimate": "outlier", "outliers": 2, "group": "each"}])
def test_every_measures_the_gap_at_one_step_in_every_each_layer_at_its_own(estimate):
    # layer 0 measures at steps 0, 3, 6, layer 1 at 2, 5: the turn to page 7 at step 1 fires in
    # each at its next measured step; both fire at step 0, where they have no selection yet
    first, second = _two_layers({"name": "score_gap", "margin": 1.0, "every": 3, **estimate})
    fired = [(_step(first, _toward(page)), _step(second, _toward(page))) for page in (2, 7, 7, 7, 7)]
    assert fired == [(True, True), (False, False), (False, True), (True, False), (False, False)]
    assert float(first.trigger_state.gap[0]) == -1e4  # a step it did not measure has no gap


def _hinting(page: int, hint: int) -> torch.Tensor:
    q = _toward(page)
    q[..., hint] = 0.2  # page ``hint`` the strongest unheld page (under RUNNER_UP), far under the margin
    return q


@pytest.mark.parametrize("turn, challengers, expected", [
    (7, 1, [True, False, True]),  # page 7 is the challenger: the step between measures it and fires
    (5, 1, [True, False, False, True]),  # page 5 is not: it waits for the measured step 3
    (7, 0, [True, False, False, True]),  # no challengers: the steps between keep the selection
])
@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton step needs a CUDA device or TRITON_INTERPRET=1"))])
def test_challengers_measure_the_steps_between_against_the_strongest_unheld_units(turn, challengers, expected,
                                                                                  backend):
    # step 0 measures (no selection yet) and keeps page 2, which the selection then holds; so step 1
    # measures whole again and keeps the strongest unheld page, 7 (the query's hint); step 2 is between
    trigger = {"name": "score_gap", "margin": 1.0, "measure": "mass", "estimate": "outlier", "outliers": 2,
               "group": "each", "every": 3, "challengers": challengers}
    device = torch.device("cuda" if backend == "triton" and torch.cuda.is_available() else "cpu")
    state = _layer(trigger, backend=backend, device=device)
    queries = [_hinting(2, 7), _hinting(2, 7)] + [_toward(turn)] * (len(expected) - 2)
    assert [_step(state, q.to(device)) for q in queries] == expected
    assert turn in _attended_pages(state)
    if challengers:
        assert state.trigger_state.challengers.shape == (1, H, HQ // H, challengers)


def test_challengers_are_checked():
    with pytest.raises(ConfigError, match="challengers must be an integer >= 0"):
        ScoreGap(challengers=-1).validate()
    with pytest.raises(ConfigError, match="challengers needs estimate 'outlier' and every >= 2"):
        ScoreGap(challengers=4, measure="mass", estimate="outlier", every=1).validate()
    with pytest.raises(ConfigError, match="challengers needs estimate 'outlier' and every >= 2"):
        ScoreGap(challengers=4, every=2).validate()
    trigger = {"name": "score_gap", "margin": 1.0, "measure": "mass", "estimate": "outlier", "group": "each",
               "every": 2, "challengers": 4}
    spec = kvpolicy.Policy(trigger=trigger, prefill_units="kmeans", selector="top_budget").to_dict()["trigger"]
    assert spec["challengers"] == 4
    assert "challengers" not in kvpolicy.Policy(trigger={**trigger, "challengers": 0}, prefill_units="kmeans",
                                                selector="top_budget").to_dict()["trigger"]


def test_count_also_fires_on_the_rank_count():
    state = _layer({"name": "score_gap", "margin": 50.0, "measure": "mass", "count": 0.5})
    fired = [_step(state, _toward(page)) for page in (2, 2, 7, 7)]
    assert fired == [True, False, True, False]


def test_new_options_are_checked_and_named_in_the_spec_only_when_set():
    with pytest.raises(ConfigError, match="margins must be a list of numbers"):
        ScoreGap(margins=[1.0, "x"]).validate()
    with pytest.raises(ConfigError, match="cap must be an integer >= 0"):
        ScoreGap(cap=-1).validate()
    with pytest.raises(ConfigError, match="group must be one of mean, each"):
        ScoreGap(group="max").validate()
    with pytest.raises(ConfigError, match="every must be an integer >= 1"):
        ScoreGap(every=0).validate()
    plain = kvpolicy.Policy(trigger={"name": "score_gap", "margin": -2.5, "measure": "mass", "leaving": "ignored"},
                            prefill_units="kmeans", selector="top_budget").to_dict()["trigger"]
    assert set(plain) == {"name", "margin", "measure", "follow", "leaving"}  # the eval's cell keys stay
    capped = kvpolicy.Policy(trigger={"name": "score_gap", "measure": "rank", "cap": 4},
                             prefill_units="kmeans", selector="top_budget").to_dict()["trigger"]
    assert capped["cap"] == 4 and capped["measure"] == "rank" and "group" not in capped and "every" not in capped


def test_group_each_fires_for_one_query_head_the_group_mean_hides():
    # query head 0 points at page 7 (unheld), head 1 away from it: the group's mean halves page 7's score
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "group": "each"})
    assert _step(state, _toward(2))
    q = _toward(2)
    q[0, 0, 2], q[0, 0, 7] = 0.0, 8.0
    q[0, 1, 7] = -8.0  # mean over the two query heads: page 7 at 0
    mean_state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass"})
    assert _step(mean_state, _toward(2))
    assert not _step(mean_state, q.clone())
    assert _step(state, q)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton step needs a CUDA device or TRITON_INTERPRET=1")
def test_the_fused_step_refuses_what_it_does_not_implement_when_the_layer_attaches():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match="triton backend's score_gap_fire does not implement group='each'"):
        _layer({"name": "score_gap", "measure": "mass", "group": "each"}, backend="triton", device=device)
    _layer({"name": "score_gap", "measure": "mass", "group": "each"}, backend="reference", device=device)
    # each query head with the outlier estimate is the fused op's (score_gap_outlier_fire)
    _layer({"name": "score_gap", "measure": "mass", "group": "each", "estimate": "outlier"}, backend="triton",
           device=device)


def test_gauss_estimate_adds_each_units_key_spread_to_its_mass():
    # pages whose keys barely spread: the same decisions as the mean estimate; the spread term is >= 0
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "gauss"})
    fired = [_step(state, _toward(page)) for page in (2, 2, 2, 7, 7, 7, 2, 2)]
    assert fired == [True, False, False, True, False, False, True, False]
    spread = state.policy.trigger._spread(_toward(7), state.trigger_state)
    assert spread.shape == state.units.size.shape and (spread >= 0).all() and spread.max() < 0.1


# a needle token of page 7 whose key stands out along a dimension no page uses (EVAL.md, "Unit summaries
# that keep their outlier keys"): its own logit is 10, its page's mean key's 10 / 16
NEEDLE, NEEDLE_DIM, DECOY_DIM = 7 * PAGE + 5, 13, 14


def _toward_needle() -> torch.Tensor:
    q = _toward(2)
    q[..., NEEDLE_DIM] = 5.0
    return q


@pytest.mark.parametrize("estimate, fires", [("mean", False), ("outlier", True)])
def test_outlier_estimate_fires_for_one_standing_out_token_the_unit_mean_hides(estimate, fires):
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": estimate},
                   spikes=[(NEEDLE, NEEDLE_DIM, 8.0)])
    assert _step(state, _toward(2))  # the first selection: pages 2 and RUNNER_UP
    assert not _step(state, _toward(2))
    assert _step(state, _toward_needle()) is fires
    if fires:  # the page the needle token is in is what the selector takes next
        assert 7 in _attended_pages(state)


def test_outlier_estimate_counts_the_m_keys_farthest_from_the_mean():
    # page 7's farthest key is a decoy the query ignores; the needle token is its second farthest
    spikes = [(NEEDLE, NEEDLE_DIM, 8.0), (7 * PAGE + 9, DECOY_DIM, 12.0)]
    one = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "outlier"}, spikes=spikes)
    two = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "outlier", "outliers": 2},
                 spikes=spikes)
    for state in (one, two):
        assert _step(state, _toward(2))
    assert not _step(one, _toward_needle())
    assert _step(two, _toward_needle())
    kept = two.trigger_state
    assert kept.outliers.valid[0, 0, 7].all() and float(kept.outliers.rest_count[0, 0, 7]) == PAGE - 2
    keys = kept.outliers.key_values()
    assert float(keys[0, 0, 7, 0, DECOY_DIM]) > 11 and float(keys[0, 0, 7, 1, NEEDLE_DIM]) > 7


def test_outlier_keys_are_kept_as_int8_within_half_a_step_of_their_values():
    # a unit's scale is its largest magnitude over 127, so each value is rounded by at most half of it;
    # a unit of zeros keeps zeros (scale 0), and the largest element is exact
    from kvpolicy.triggers.outlier_keys import to_int8

    gen = torch.Generator().manual_seed(3)
    values = torch.randn(2, 3, 5, 4, 16, generator=gen) * torch.rand(2, 3, 5, 1, 1, generator=gen) * 20
    values[0, 0, 1] = 0.0
    kept, scale = to_int8(values, unit_dims=2)
    assert kept.dtype == torch.int8 and scale.shape == (2, 3, 5)
    back = kept.float() * scale[..., None, None]
    assert ((back - values).abs() <= scale[..., None, None] / 2 + 1e-6).all()
    assert float(scale[0, 0, 1]) == 0.0 and not back[0, 0, 1].any()
    torch.testing.assert_close(back.abs().amax(dim=(-1, -2)), values.abs().amax(dim=(-1, -2)))


def test_outlier_estimate_with_group_each_fires_for_one_query_heads_outlier():
    # query head 0 looks at the needle token, head 1 away from it: the group's mean cancels it
    q = _toward_needle()
    q[0, 1, NEEDLE_DIM] = -5.0
    fired = {}
    for group in ("mean", "each"):
        state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "outlier",
                        "group": group}, spikes=[(NEEDLE, NEEDLE_DIM, 8.0)])
        assert _step(state, _toward(2))
        fired[group] = _step(state, q.clone())
    assert fired == {"mean": False, "each": True}


def test_outlier_estimate_decides_as_the_mean_where_no_key_stands_out():
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "outlier", "outliers": 3})
    fired = [_step(state, _toward(page)) for page in (2, 2, 2, 7, 7, 7, 2, 2)]
    assert fired == [True, False, False, True, False, False, True, False]


def test_outliers_is_checked_and_named_in_the_spec_only_when_set():
    with pytest.raises(ConfigError, match="outliers must be an integer >= 1"):
        ScoreGap(measure="mass", estimate="outlier", outliers=0).validate()
    with pytest.raises(ConfigError, match="outliers is read by estimate 'outlier' only"):
        ScoreGap(measure="mass", outliers=2).validate()
    spec = kvpolicy.Policy(trigger={"name": "score_gap", "measure": "mass", "estimate": "outlier"},
                           prefill_units="kmeans", selector="top_budget").to_dict()["trigger"]
    assert spec["estimate"] == "outlier" and "outliers" not in spec
    spec = kvpolicy.Policy(trigger={"name": "score_gap", "measure": "mass", "estimate": "outlier", "outliers": 2},
                           prefill_units="kmeans", selector="top_budget").to_dict()["trigger"]
    assert spec["outliers"] == 2


def _hinting_needle(hint: int) -> torch.Tensor:
    q = _toward_needle()
    # page ``hint`` the strongest unheld page to a first pass blind to the needle's dimension, and under the
    # margin (its log mass 4.3, the held pages' 6.6)
    q[..., hint] = 2.0
    return q


@pytest.mark.parametrize("rank, top, fires", [
    (0, 16, True),  # no first pass: every unit measured whole
    (11, 1, True),  # the needle's dimension is the 11th direction of most prompt key energy (pages 0-9 first)
    # mostly outside the basis (page 7's direction holds a quarter of it): the first pass ranks page 5 first,
    # and the needle's page is not measured
    (10, 1, False),
    (10, 64, True),  # a top as large as the table: every unit measured whole again
])
def test_a_low_rank_first_pass_measures_whole_only_the_units_it_ranks_highest(rank, top, fires):
    state = _layer({"name": "score_gap", "margin": -1.0, "measure": "mass", "estimate": "outlier", "group": "each",
                    "low_rank": rank, "low_rank_top": top}, spikes=[(NEEDLE, NEEDLE_DIM, 8.0)])
    assert _step(state, _toward(2))  # the first selection: pages 2 and RUNNER_UP
    assert not _step(state, _toward(2))
    assert _step(state, _hinting_needle(5)) is fires
    if rank:
        basis = state.trigger_state.key_basis[0, 0]
        assert basis.shape == (D, rank)
        torch.testing.assert_close(basis.T @ basis, torch.eye(rank), atol=1e-5, rtol=0)
        assert float(basis[NEEDLE_DIM].norm()) > 0.99 if rank == 11 else float(basis[NEEDLE_DIM].norm()) < 0.3


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton step needs a CUDA device or TRITON_INTERPRET=1")
def test_low_rank_is_checked_refused_by_the_fused_step_and_named_in_the_spec_only_when_set():
    outlier = {"measure": "mass", "estimate": "outlier"}
    with pytest.raises(ConfigError, match="low_rank must be an integer >= 0"):
        ScoreGap(**outlier, low_rank=-1).validate()
    with pytest.raises(ConfigError, match="low_rank_top must be an integer >= 1"):
        ScoreGap(**outlier, low_rank=4, low_rank_top=0).validate()
    with pytest.raises(ConfigError, match="low_rank needs estimate 'outlier' and no challengers"):
        ScoreGap(measure="mass", low_rank=4).validate()
    with pytest.raises(ConfigError, match="low_rank needs estimate 'outlier' and no challengers"):
        ScoreGap(**outlier, every=2, challengers=4, low_rank=4).validate()
    with pytest.raises(ConfigError, match=f"low_rank must be at most the head dimension \\({D}\\), got {D + 1}"):
        _layer({"name": "score_gap", **outlier, "low_rank": D + 1})
    with pytest.raises(ConfigError, match="does not implement low_rank=4 .accepted: 0."):
        # on the Triton step's device: a CUDA device where there is one (its kernels refuse CPU tensors uninterpreted)
        _layer({"name": "score_gap", **outlier, "low_rank": 4}, backend="triton",
               device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    spec = kvpolicy.Policy(trigger={"name": "score_gap", **outlier}, prefill_units="kmeans",
                           selector="top_budget").to_dict()["trigger"]
    assert "low_rank" not in spec and "low_rank_top" not in spec
    spec = kvpolicy.Policy(trigger={"name": "score_gap", **outlier, "low_rank": 16, "low_rank_top": 8}, prefill_units="kmeans",
                           selector="top_budget").to_dict()["trigger"]
    assert (spec["low_rank"], spec["low_rank_top"]) == (16, 8)
