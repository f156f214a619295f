"""The score-gap trigger's fused ops (kernels/triton/score_gap.py) against their references
(``reference_step.score_gap_fire`` and ``score_gap_selected``) on fresh random trigger states:
the decision and the held list bit for bit, the gap to float32 rounding (a blocked logsumexp),
over several steps, so that the held marks are tested to follow the held list."""

from __future__ import annotations

import copy
import math
import os
from types import SimpleNamespace

import pytest
import torch

from kvpolicy.kernels import dispatch, reference_step
from kvpolicy.triggers.score_gap import ScoreGap, ScoreGapState

from gpu_cross import GPU_CROSS, cross

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="Triton needs a CUDA device or TRITON_INTERPRET=1",
)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# a bfloat16 product: Triton's interpreter multiplies bfloat16 tiles as their raw bits (triton 3.9)
ON_GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="Triton's interpreter multiplies bfloat16 tiles as their raw bits")
STATE_TENSORS = ("held", "held_end", "held_count", "seen_open", "seen_size", "seen_admitted", "has_selection", "age",
                 "steps")


def _state(gen: torch.Generator, batch: int, heads: int, units: int, room: int, prompt_units: int,
           admit: str, above: bool) -> ScoreGapState:
    """A trigger state in the middle of a decode: held lists of distinct ids (some -1), an open
    unit that is sometimes listed, and last-look values that make every branch of the follow-up
    happen somewhere (moved on or grew or neither; admitted or not)."""
    def ints(low, high, *shape):
        return torch.randint(low, high, shape, generator=gen)

    held = torch.full((batch, heads, room), -1, dtype=torch.long)
    for b in range(batch):
        for h in range(heads):
            n = int(ints(0, min(room, units) + 1))
            held[b, h, :n] = torch.randperm(units, generator=gen)[:n]
    held[torch.rand(held.shape, generator=gen) < 0.2] = -1  # dropped entries inside the list
    open_unit = ints(prompt_units - 1, units, batch)
    open_unit[0] = -1  # no decode unit open yet
    listed = torch.rand(batch, heads, generator=gen) < 0.4
    # a unit is listed once (as a selection and the follow-up make it): the open unit leaves the list first
    listed = listed & (open_unit >= 0).view(-1, 1)
    held[..., 1:] = torch.where(listed.unsqueeze(-1) & (held[..., 1:] == open_unit.view(-1, 1, 1)), -1, held[..., 1:])
    held[..., 0] = torch.where(listed, open_unit.view(-1, 1), held[..., 0])
    size = ints(0, 6, batch, heads, units)
    admitted = ints(0, 20, batch, heads)
    units_table = SimpleNamespace(size=size, open_unit=open_unit, num_prompt_units=prompt_units, capacity=units,
                                  decode_units=ints(0, units - prompt_units, batch))
    store = SimpleNamespace(admitted=admitted, kept=ints(0, room + 2, batch, heads), retrieval_capacity=room - 2)
    layer = SimpleNamespace(units=units_table, store=store, policy=SimpleNamespace(admit=admit), layer_idx=1,
                            reselect=torch.rand(batch, generator=gen) < 0.5)
    gather = open_unit.clamp(min=0).view(-1, 1, 1).expand(batch, heads, 1)
    state = ScoreGapState(
        has_selection=torch.rand(batch, generator=gen) < 0.8, layer=layer, gap=torch.zeros(batch),
        held=held, held_count=ints(0, room + 2, batch, heads),
        seen_open=torch.where(torch.rand(batch, generator=gen) < 0.5, open_unit, open_unit - 1),
        seen_size=size.gather(2, gather)[..., 0] - ints(0, 2, batch, heads),
        seen_admitted=admitted - ints(0, 2, batch, heads),
        held_end=ints(0, room + 3, batch, heads, room), units_at_selection=ints(0, units - prompt_units, batch),
        above=SimpleNamespace(reselect=torch.rand(batch, generator=gen) < 0.5) if above else None,
        age=ints(0, 5, batch), steps=ints(0, 7, batch),
    )
    return _to(state, DEVICE)


def _to(obj, device):
    for name, value in vars(obj).items():
        if isinstance(value, torch.Tensor):
            setattr(obj, name, value.to(device))
        elif isinstance(value, SimpleNamespace):
            _to(value, device)
    return obj


def _scores(gen: torch.Generator, state: ScoreGapState) -> torch.Tensor:
    batch, heads, room = state.held.shape
    units = state.layer.units.capacity
    scores = 4 * torch.randn(batch, heads, units, generator=gen)
    scores[torch.rand(scores.shape, generator=gen) < 0.15] = float("-inf")  # not selectable
    scores[-1, -1] = float("-inf")  # a head with nothing selectable
    return scores.to(DEVICE)


def _next_look(gen: torch.Generator, state: ScoreGapState) -> None:
    """The table and buffer one step on: the open unit moves or grows, the buffer admits or not."""
    units, store = state.layer.units, state.layer.store
    moved = (torch.rand(units.open_unit.shape, generator=gen) < 0.5).to(DEVICE)
    units.open_unit.copy_(torch.where(moved, (units.open_unit + 1).clamp(max=units.capacity - 1), units.open_unit))
    units.size.add_(torch.randint(0, 2, units.size.shape, generator=gen).to(DEVICE))
    store.admitted.add_(torch.randint(0, 2, store.admitted.shape, generator=gen).to(DEVICE))


def _assert_marks_follow_the_list(state: ScoreGapState, where: str) -> None:
    """The Triton ops' held marks are the held list as a mask (``score_gap.held_marks``)."""
    want = reference_step.held_units_mask(state.held, state.layer.units.capacity)
    assert state.held_marks is not None, f"{where}: no held marks"
    wrong = (state.held_marks.bool() != want).nonzero().tolist()
    assert not wrong, f"{where}: the held marks differ from the list at (sequence, head, unit) {wrong[:5]}"


def _assert_same_step(got: torch.Tensor, want: torch.Tensor, fast: ScoreGapState, ref: ScoreGapState,
                      where: str) -> None:
    """A fused step against the reference's: the decision and the state bit for bit, the gap to
    float32 rounding, and the held marks the held list's."""
    assert torch.equal(got, want), f"{where}: fire {got.tolist()} != {want.tolist()} (gap {ref.gap.tolist()})"
    torch.testing.assert_close(fast.gap, ref.gap, rtol=1e-5, atol=1e-5, equal_nan=True, msg=where)
    for name in STATE_TENSORS:
        assert torch.equal(getattr(fast, name), getattr(ref, name)), f"{where}: {name} differs"
    _assert_marks_follow_the_list(fast, where)


# ``every`` 3: a sequence's layer measures the gap at one step in three (its steps counted), skipping the rest.
# On the CPU (gpu_cross) each measure with each option set, the leaving rules alternating, so that every
# (measure, leaving, admit) triple runs (the follow launch branches on the leaving rule, ``admit="evict"`` and
# measure "rank" together; the gap blocks on the leaving rule and the measure; the decide launch on the measure,
# ``every``, ``follow`` and ``cap``), with the held list past one block of the follow-up (mass, unheld, evict)
@pytest.mark.parametrize("measure, leaving, admit, follow, cap, every", cross(
    [("weakest", "unheld"), ("weakest", "ignored"), ("mass", "unheld"), ("mass", "ignored"), ("rank", "unheld"),
     ("rank", "ignored")],
    [("room", 0.0, 0, 1), ("evict", 0.0, 3, 1), ("room", 1.5, 0, 3), ("evict", math.inf, 0, 1)],
    on_cpu=[(0, 0), (3, 0), (4, 0), (1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (5, 2), (0, 3), (3, 3), (5, 3)]))
def test_score_gap_fire_matches_reference(measure, leaving, admit, follow, cap, every, monkeypatch):
    from kvpolicy.kernels.triton import score_gap

    triton_ops = dispatch.bind("triton", DEVICE)
    by_gap = kept = between = 0
    decide_block = score_gap._DECIDE_BLOCK
    for seed in range(3):
        # at seed 1 a row stage combines the blocks' parts, reading them one at a time (its running
        # merges), before the decide launch
        monkeypatch.setattr(score_gap, "_DECIDE_BLOCK", 1 if seed == 1 else decide_block)
        gen = torch.Generator().manual_seed(seed)
        # margins below and past any gap of these scores (rows that fire, rows that keep), and one between
        # (a count of units for rank: under any, past any, and a few)
        if measure == "rank":
            margin = (-0.5, 3.0 + float(torch.rand(1, generator=gen)) * 10, 1e5)[seed]
        else:
            margin = (-8.0, float(torch.randn(1, generator=gen)), 8.0)[seed]
        # with a cap, the margin comes from ``margins`` (this layer is index 1)
        trigger = ScoreGap(margin=margin if not cap else 99.0, measure=measure, leaving=leaving, follow=follow,
                           cap=cap, margins=(99.0, margin) if cap else (), every=every)
        # past one block of units (1,024), so the running logsumexp rescales; one case a follow value
        # with a held list past one block of the follow-up (4,096 rows), evicting and dropping
        room, units = (5000, 6000) if (measure, leaving, admit) == ("mass", "unheld", "evict") else (12, 1500)
        ref = _state(gen, batch=3, heads=2, units=units, room=room, prompt_units=units - 100, admit=admit,
                     above=follow > 0)
        fast = copy.deepcopy(ref)
        for step in range(3):
            scores = _scores(gen, ref)
            scale = 0.25
            had = ref.has_selection.clone()
            want = reference_step.score_gap_fire(trigger, ref, scores, scale)
            got = triton_ops.score_gap_fire(trigger, fast, scores.clone(), scale)
            _assert_same_step(got, want, fast, ref, f"seed {seed} step {step}")
            by_gap += int((want & had).sum())  # fired on the gap, not for want of a selection
            kept += int((~want).sum())
            look = torch.Generator().set_state(gen.get_state())  # the same next look for both
            _next_look(gen, ref)
            _next_look(look, fast)
    assert by_gap and kept, f"not both decisions were tested: {by_gap} fired on the gap, {kept} kept"


@pytest.mark.parametrize("measure", ["mass", "rank"])
def test_score_gap_fire_writes_the_decision_as_note_decision_does(measure):
    """Given the layer's ``Decision``, the fused op's last launch writes it (no note launch): as
    the reference fire followed by ``note_decision``, bit for bit, over steps whose decisions differ."""
    from kvpolicy.triggers.base import Decision

    triton_ops = dispatch.bind("triton", DEVICE)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    # a margin no gap reaches: the trigger fires where its state has no selection (row 0), and the
    # layer's decision is also True where the layer has none yet (row 1, at the first step)
    trigger = ScoreGap(margin=1e5, measure=measure, leaving="ignored")
    ref = _state(gen, batch=4, heads=2, units=1500, room=12, prompt_units=1400, admit="room", above=False)
    ref.has_selection.copy_(torch.tensor([False, True, True, True]))
    fast = copy.deepcopy(ref)
    capacity = 40

    def decision():
        return Decision(has_selection=(torch.rand(4, generator=gen) < 0.7).to(DEVICE),
                        reselections=torch.randint(0, 9, (4,), generator=gen).to(DEVICE),
                        boundary=(torch.rand(4, capacity, generator=gen) < 0.5).to(DEVICE),
                        slot=torch.tensor(0, device=DEVICE), reselect=torch.zeros(4, dtype=torch.bool, device=DEVICE))

    want = decision()
    want.has_selection.copy_(torch.tensor([True, False, True, True]))
    got = Decision(*(t.clone() for t in want))
    decision_before = want.reselections.tolist()
    seen = set()
    for step in range(4):
        want.slot.fill_(20 + step)
        got.slot.fill_(20 + step)
        scores = _scores(gen, ref)
        fire = reference_step.score_gap_fire(trigger, ref, scores, 0.25)
        reference_step.note_decision(fire, *want)
        fired = triton_ops.score_gap_fire(trigger, fast, scores.clone(), 0.25, decision=got)
        assert torch.equal(fired, fire), f"step {step}: fire differs"
        for name, a, b in zip(Decision._fields, got, want):
            assert torch.equal(a, b), f"step {step}: {name} differs from note_decision's"
        seen.update(want.reselect.tolist())
        look = torch.Generator().set_state(gen.get_state())
        _next_look(gen, ref)
        _next_look(look, fast)
    assert seen == {True, False}, "every row decided alike: the note was not tested both ways"
    assert want.reselections.tolist() != decision_before, "no decision was counted"


# fewer ids than the held list's length, as many, more; a held list past one block (1,024 rows)
@pytest.mark.parametrize("listed, room", [(5, 12), (12, 12), (20, 12), (1500, 1100)])
def test_score_gap_selected_matches_reference(listed, room):
    triton_ops = dispatch.bind("triton", DEVICE)
    capped = 0
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        units = 2 * listed + 50
        ref = _state(gen, batch=4, heads=2, units=units, room=room, prompt_units=40, admit="room", above=False)
        if room > 1024:  # units of one token: the list reaches the cap in its second block
            ref.layer.units.size.fill_(1)
        fast = copy.deepcopy(ref)
        ids = torch.stack([torch.stack([torch.randperm(units, generator=gen)[:listed] for _ in range(2)])
                           for _ in range(4)])
        cut = torch.randint(0, listed + 1, (4, 2, 1), generator=gen)
        ids = torch.where(torch.arange(listed) < cut, ids, -1).to(DEVICE)  # chosen units, then -1
        reselect = torch.tensor([True, False, True, True], device=DEVICE)
        reference_step.score_gap_selected(ref, ids, reselect)
        triton_ops.score_gap_selected(fast, ids, reselect)
        for name in (*STATE_TENSORS, "units_at_selection"):
            assert torch.equal(getattr(fast, name), getattr(ref, name)), f"seed {seed}: {name} differs"
        _assert_marks_follow_the_list(fast, f"seed {seed}")
        capped += int((ref.held_end[reselect] == ref.layer.store.retrieval_capacity).sum())
    assert capped, "no selection reached the buffer's capacity: the cap went untested"


@pytest.mark.parametrize("measure", ["weakest", "mass"])
def test_an_overflowed_held_score_decides_as_the_reference(measure):
    # a +inf score (a float32 overflow) on a held unit: logsumexp gives +inf, not NaN, so that head
    # cannot fire and the other heads still decide
    gen = torch.Generator().manual_seed(4)
    trigger = ScoreGap(margin=0.0, measure=measure)
    ref = _state(gen, batch=3, heads=2, units=70, room=12, prompt_units=40, admit="room", above=False)
    ref.held[:, 0, 0] = 3
    ref.layer.units.open_unit.fill_(-1)  # no follow-up: unit 3 stays held
    fast = copy.deepcopy(ref)
    scores = _scores(gen, ref)
    scores[:, 0, 3] = float("inf")
    want = reference_step.score_gap_fire(trigger, ref, scores, 0.25)
    got = dispatch.bind("triton", DEVICE).score_gap_fire(trigger, fast, scores.clone(), 0.25)
    assert torch.equal(got, want)
    torch.testing.assert_close(fast.gap, ref.gap, equal_nan=True)
    assert not ref.gap[:2].isnan().any()  # (the last row has a head with nothing selectable: NaN in mass)


def test_score_gap_fire_rank_counts_the_unheld_units_above_the_held_mean():
    # one head: held scores 1, 3 (mean 2); unheld 2.5, 4 and 1.5: two unheld units above the mean
    gen = torch.Generator().manual_seed(5)
    ref = _state(gen, batch=1, heads=1, units=8, room=4, prompt_units=6, admit="room", above=False)
    ref.held.copy_(torch.tensor([[[0, 1, -1, -1]]], device=DEVICE))
    ref.has_selection.fill_(True)
    ref.layer.units.open_unit.fill_(-1)  # no follow-up
    fast = copy.deepcopy(ref)
    scores = torch.tensor([[[1.0, 3.0, 2.5, 4.0, 1.5, float("-inf"), float("-inf"), float("-inf")]]], device=DEVICE)
    for margin, fires in ((1.5, True), (2.0, False)):
        trigger = ScoreGap(margin=margin, measure="rank", leaving="unheld")
        want = reference_step.score_gap_fire(trigger, ref, scores, 1.0)
        got = dispatch.bind("triton", DEVICE).score_gap_fire(trigger, fast, scores.clone(), 1.0)
        assert bool(want[0]) is fires and torch.equal(got, want)
        assert float(ref.gap[0]) == float(fast.gap[0]) == 2.0


@pytest.mark.parametrize("option", [{"estimate": "bound"}, {"estimate": "gauss"}, {"group": "each"},
                                    {"count": 4.0}])
def test_the_fused_op_refuses_the_options_it_does_not_implement(option):
    from kvpolicy.errors import ConfigError

    gen = torch.Generator().manual_seed(6)
    state = _state(gen, batch=2, heads=2, units=70, room=12, prompt_units=40, admit="room", above=False)
    trigger = ScoreGap(margin=-2.5, measure="mass", **option)
    name = next(iter(option))
    with pytest.raises(ConfigError, match=f"{name}=.*accepted"):
        dispatch.bind("triton", DEVICE).score_gap_fire(trigger, state, _scores(gen, state), 0.25)


def _with_outlier_keys(gen: torch.Generator, state: ScoreGapState, dim: int, m: int) -> None:
    """The unit table's float16 mean keys and selectable mask, and a random int8 ``OutlierKeys`` for its
    prompt units: some outliers missing, some units with no other token, some with no outlier."""
    from kvpolicy.triggers.outlier_keys import OutlierKeys, to_int8

    units = state.layer.units
    batch, heads, capacity = units.size.shape
    prompt = units.num_prompt_units
    units.key_mean = torch.randn(batch, heads, capacity, dim, generator=gen).half().to(DEVICE)
    units.selectable = (torch.rand(batch, heads, capacity, generator=gen) < 0.85).to(DEVICE)
    valid = torch.rand(batch, heads, prompt, m, generator=gen) < 0.7
    valid[:, :, :5] = False  # no outlier: the rest alone
    rest_count = torch.randint(0, 20, (batch, heads, prompt), generator=gen).float()
    rest_count[:, :, 5:10] = 0.0  # every token an outlier
    keys, key_scale = to_int8(3 * torch.randn(batch, heads, prompt, m, dim, generator=gen), unit_dims=2)
    rest, rest_scale = to_int8(torch.randn(batch, heads, prompt, dim, generator=gen), unit_dims=1)
    state.outliers = OutlierKeys(keys=keys.to(DEVICE), key_scale=key_scale.to(DEVICE), valid=valid.to(DEVICE),
                                 rest_mean=rest.to(DEVICE), rest_scale=rest_scale.to(DEVICE),
                                 rest_count=rest_count.to(DEVICE))


# a bfloat16 query (each query head's own): the kernel's tf32 product, exact for it and the int8 and
# float16 keys, on the GPU; a float32 query (a group's mean too): a float32 product
# and, with a bfloat16 query, the blocks kernel's other settings (benchmarks/outlier_blocks.py times
# them): the key loop software-pipelined with a wide row stage; the keys' product in bfloat16 (exact
# too), on the GPU only
# ``fixed``: ``ScoreGap.fixed_query``, int8 products with the query's fixed-point digits
_OUTLIER_SETTINGS = [
    ("each", torch.float32, "tf32", 0, 64, False), ("mean", torch.float32, "tf32", 0, 64, False),
    ("each", torch.bfloat16, "tf32", 0, 64, False), ("each", torch.bfloat16, "tf32", 2, 256, False),
    ("each", torch.bfloat16, "tf32", 0, 64, True), ("mean", torch.float32, "tf32", 0, 256, True)]
# ``challengers``: the steps between measured ones score the held units and the challengers alone
_OUTLIER_OPTIONS = [
    ("ignored", "room", 0.0, 0, 1, 0), ("unheld", "evict", 1.5, 6, 1, 0), ("ignored", "room", 0.0, 0, 2, 0),
    ("ignored", "room", 0.0, 0, 3, 4), ("unheld", "evict", 1.5, 0, 2, 2)]


# On the CPU (gpu_cross) every setting and option set, and the pairs the kernels branch on together: challengers
# (the steps between, the row stage's merge) with the query in fixed point and not, a group's mean and each
# head's, a float32 and a bfloat16 query, the pipelined key loop and the unrolled one, and a row stage reading its
# parts one at a time and all at once (at seed 1); the same row stage without challengers both ways; the decision
# in the blocks launch (no challengers, every step) with a group's mean and each head's, in fixed point (the
# preset's) and not; ``every`` without challengers (the decide launch). (The test below runs the first setting
# with challengers, ``every`` 3, in each way of scoring the steps between.)
@pytest.mark.parametrize("group, dtype, product, stages, row_span, fixed, leaving, admit, follow, cap, every, "
                         "challengers", cross(
                             _OUTLIER_SETTINGS, _OUTLIER_OPTIONS,
                             on_cpu=[(1, 0), (4, 0), (3, 1), (0, 2), (2, 2), (1, 3), (5, 4), (3, 4)]) + [
    pytest.param("each", torch.bfloat16, "query", 0, 64, False, *options, marks=ON_GPU_ONLY)
    for options in _OUTLIER_OPTIONS],
    ids=lambda value: str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None)
def test_score_gap_outlier_fire_matches_reference(group, dtype, product, stages, row_span, fixed, leaving, admit,
                                                  follow, cap, every, challengers, monkeypatch):
    """The fused outlier op (scoring included) against ``reference_step.score_gap_outlier_fire``:
    decisions and state bit for bit (the challengers as sets), the gap to float32 rounding, over steps
    and several blocks of units (at seed 1 a row stage combines their parts, one at a time or all at
    once: its running logsumexp); a head dimension that is not a power of two; 3 query heads a KV head."""
    from kvpolicy.kernels.triton import score_gap, score_gap_outlier

    triton_ops = dispatch.bind("triton", DEVICE)
    by_gap = kept = between = 0
    decide_block = score_gap._DECIDE_BLOCK
    monkeypatch.setattr(score_gap_outlier, "_KEY_PRODUCT", product)
    monkeypatch.setattr(score_gap_outlier, "_KEY_STAGES", stages)
    for seed in range(3):
        monkeypatch.setattr(score_gap, "_DECIDE_BLOCK", 1 if seed == 1 else decide_block)
        monkeypatch.setattr(score_gap, "_ROW_SPAN", 1 if seed == 1 and row_span < 256 else row_span)
        gen = torch.Generator().manual_seed(100 + seed)
        margin = (-6.0, float(torch.randn(1, generator=gen)), 40.0)[seed]  # fires, some, keeps (but a cap)
        trigger = ScoreGap(margin=margin if not cap else 99.0, measure="mass", leaving=leaving, follow=follow, cap=cap,
                           margins=(99.0, margin) if cap else (), estimate="outlier", outliers=3, group=group,
                           every=every, challengers=challengers, fixed_query=fixed)
        trigger.validate()
        # 2 sequences (the interpreter runs a launch's programs one by one: a sequence's cost), the first with no
        # decode unit open at first: every branch of the follow-up still happens in each case, both decisions,
        # and with challengers steps between measured ones
        ref = _state(gen, batch=2, heads=2, units=400, room=12, prompt_units=300, admit=admit, above=follow > 0)
        _with_outlier_keys(gen, ref, dim=24, m=3)
        if seed == 2:  # every row has a selection: with the largest margin some keep it
            ref.has_selection.fill_(True)
        fast = copy.deepcopy(ref)
        for step in range(5 if challengers else 3):
            query = torch.randn(2, 6, 24, generator=gen).to(DEVICE, dtype)
            had = ref.has_selection.clone()
            kept_before = None if ref.challengers is None else ref.challengers.clone()
            want = reference_step.score_gap_outlier_fire(trigger, ref, query, 0.2)
            got = triton_ops.score_gap_outlier_fire(trigger, fast, query.clone(), 0.2)
            _assert_same_step(got, want, fast, ref, f"seed {seed} step {step}")
            if challengers:
                assert torch.equal(fast.challengers.sort(-1).values, ref.challengers.sort(-1).values), \
                    f"seed {seed} step {step}: challengers differ"
                between += int(kept_before is not None and torch.equal(kept_before, ref.challengers))
            by_gap += int((want & had).sum())
            kept += int((~want).sum())
            look = torch.Generator().set_state(gen.get_state())
            _next_look(gen, ref)
            _next_look(look, fast)
    assert by_gap and kept, f"not both decisions were tested: {by_gap} fired on the gap, {kept} kept"
    assert between or not challengers, "no step kept its challengers: the steps between were not tested"


# a step between measured ones in the blocks launch or its own, its keys a tile or a loop (the test above
# runs the shipped settings, "own" and "loop")
# (``fixed``: the keys as a tile with the query in fixed point, ``ScoreGap.fixed_query``). On the CPU each launch
# with each way of reading the keys, and each way with the query in fixed point and not (the shipped "own" and
# "loop" run above, in fixed point too): "own" and "tile" in float runs on the GPU (gpu_cross)
@pytest.mark.parametrize("launch, keys, fixed", [("blocks", "tile", False),
                                                 pytest.param("own", "tile", False, marks=GPU_CROSS),
                                                 ("blocks", "loop", False), ("own", "tile", True)])
def test_outlier_fire_between_settings_match_reference(launch, keys, fixed, monkeypatch):
    """With challengers, each setting of the steps between measured ones against the reference, as above."""
    from kvpolicy.kernels.triton import score_gap_outlier

    monkeypatch.setattr(score_gap_outlier, "_BETWEEN_LAUNCH", launch)
    monkeypatch.setattr(score_gap_outlier, "_BETWEEN_KEYS", keys)
    test_score_gap_outlier_fire_matches_reference("each", torch.float32, "tf32", 0, 64, fixed, "ignored", "room", 0.0,
                                                  0, 3, 4, monkeypatch)


# the preset's options (measured every step, no challengers), with the layer above's follow and a cap, or without
# (a cap the states' ages do not reach in these steps: its count is tested, and the gap still decides)
@pytest.mark.parametrize("leaving, admit, follow, cap", [("ignored", "room", 0.0, 0), ("unheld", "evict", 1.5, 12)])
def test_outlier_fire_decided_in_the_blocks_launch_as_by_the_decide_launch(leaving, admit, follow, cap, monkeypatch):
    """``score_gap_outlier._DECIDE_IN_BLOCKS_UP_TO``: each sequence's last blocks program decides, and writes the layer's
    ``Decision``, bit for bit as the decide launch after the blocks launch does, over steps that fire and keep."""
    from kvpolicy.kernels.triton import score_gap_outlier
    from kvpolicy.triggers.base import Decision

    triton_ops = dispatch.bind("triton", DEVICE)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, ())))
    options = dict(measure="mass", leaving=leaving, follow=follow, cap=cap, estimate="outlier", outliers=3,
                   group="each", fixed_query=True)
    # 3 blocks of units a row at D = 24 (256 units a block): more than one program of a sequence takes a ticket
    # (its 3 blocks x 2 KV heads); 5 sequences, the first with no selection (it fires), the others deciding on
    # the gap (the interpreter runs the programs one by one: a sequence's cost). Not fewer: a row whose heads hold
    # nothing has no finite gap at any step, one in ten with "evict", and with none finite there is no margin
    batch = 5
    launched = _state(gen, batch=batch, heads=2, units=600, room=12, prompt_units=500, admit=admit,
                      above=follow > 0)
    _with_outlier_keys(gen, launched, dim=24, m=3)
    launched.has_selection.copy_(torch.tensor([False] + [True] * (batch - 1)))
    fused = copy.deepcopy(launched)
    queries = [torch.randn(batch, 6, 24, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(6)]
    # the margin: the median of the reference's finite gaps over the same steps in the rows with a selection (a
    # row with nothing held has an infinite one), so the steps fire on some rows and keep others (the gaps do not
    # depend on the margin)
    probe, look = copy.deepcopy(launched), torch.Generator().set_state(gen.get_state())
    finite = []
    for query in queries:
        reference_step.score_gap_outlier_fire(ScoreGap(margin=0.0, **options), probe, query, 0.2)
        # (a row whose layer above re-selected compares its gap with the margin less ``follow``)
        lowered = [follow * bool(above) for above in (probe.above.reselect.tolist() if follow else [0] * batch)]
        finite += [g + low for g, low in list(zip(probe.gap.tolist(), lowered))[1:] if abs(g) < 1e4]
        _next_look(look, probe)
    trigger = ScoreGap(margin=float(torch.tensor(finite).median()), **options)
    trigger.validate()

    def decision():
        return Decision(has_selection=(torch.rand(batch, generator=gen) < 0.7).to(DEVICE),
                        reselections=torch.randint(0, 9, (batch,), generator=gen).to(DEVICE),
                        boundary=(torch.rand(batch, 40, generator=gen) < 0.5).to(DEVICE),
                        slot=torch.tensor(0, device=DEVICE),
                        reselect=torch.zeros(batch, dtype=torch.bool, device=DEVICE))

    want = decision()
    got = Decision(*(t.clone() for t in want))
    decided, gaps = [], []
    launches = []  # the decide launches made: the launched path's only
    decide = score_gap_outlier.decide_from_parts
    monkeypatch.setattr(score_gap_outlier, "decide_from_parts",
                        lambda *args, **kw: (launches.append(score_gap_outlier._DECIDE_IN_BLOCKS_UP_TO), decide(*args, **kw)))
    for step, query in enumerate(queries):
        want.slot.fill_(10 + step)
        got.slot.fill_(10 + step)
        monkeypatch.setattr(score_gap_outlier, "_DECIDE_IN_BLOCKS_UP_TO", 0)
        fire = triton_ops.score_gap_outlier_fire(trigger, launched, query, 0.2, decision=want)
        monkeypatch.setattr(score_gap_outlier, "_DECIDE_IN_BLOCKS_UP_TO", 16)
        fired = triton_ops.score_gap_outlier_fire(trigger, fused, query.clone(), 0.2, decision=got)
        assert torch.equal(fired, fire), f"step {step}: fire differs"
        assert torch.equal(fused.gap, launched.gap), f"step {step}: gap {fused.gap} != {launched.gap}"
        for name, a, b in zip(Decision._fields, got, want):
            assert torch.equal(a, b), f"step {step}: the decision's {name} differs"
        for name in ("held", "held_count", "held_end", "seen_open", "seen_size", "seen_admitted", "age",
                     "held_marks"):
            a, b = getattr(fused, name), getattr(launched, name)
            assert (a is None and b is None) or torch.equal(a, b), f"step {step}: state {name} differs"
        decided += fire.tolist()
        gaps.append([round(g, 2) for g in launched.gap.tolist()])
        look = torch.Generator().set_state(gen.get_state())  # the same next look for both
        _next_look(gen, launched)
        _next_look(look, fused)
    assert set(decided) == {True, False}, (f"the steps decided alike ({decided}; margin {trigger.margin:.2f}, gaps "
                                           f"{gaps}): both ways were not tested")
    assert launches == [0] * len(queries), f"the decide launch ran where the blocks launch decides: {launches}"
    tickets = score_gap_outlier.zeroed(DEVICE, "score_gap_outlier_decide", (batch,))
    assert not tickets.any(), f"the tickets were not left at zero: {tickets.tolist()}"


def test_outlier_log_mass_counts_each_outlier_by_its_own_logit():
    """``outlier_log_mass`` by hand: a prompt unit with one outlier at logit 4 and 3 other tokens at 0
    has log mass log(e**4 + 3); a decode unit of 2 tokens at logit 1, 1 + log 2; not selectable, -inf."""
    from kvpolicy.triggers.outlier_keys import OutlierKeys

    dim = 4
    units = SimpleNamespace(key_mean=torch.zeros(1, 1, 3, dim, dtype=torch.float16),
                            size=torch.tensor([[[4, 2, 5]]]), selectable=torch.tensor([[[True, True, False]]]))
    units.key_mean[0, 0, 1, 0] = 1.0
    outliers = OutlierKeys(keys=torch.zeros(1, 1, 1, 2, dim, dtype=torch.int8), key_scale=torch.tensor([[[0.5]]]),
                           valid=torch.tensor([[[[True, False]]]]),
                           rest_mean=torch.zeros(1, 1, 1, dim, dtype=torch.int8), rest_scale=torch.tensor([[[1.0]]]),
                           rest_count=torch.tensor([[[3.0]]]))
    outliers.keys[0, 0, 0, 0, 1] = 4  # 4 x the scale 0.5: 2.0
    outliers.keys[0, 0, 0, 1, 1] = 100  # not a real outlier: never counted
    query = torch.zeros(1, 2, dim)
    query[0, :, 0] = 1.0
    query[0, 0, 1], query[0, 1, 1] = 2.0, -2.0  # head 0 sees the outlier at 4, head 1 at -4; their mean at 0
    each = reference_step.outlier_log_mass(outliers, units, query, 1.0, each=True)
    assert each.shape == (1, 1, 2, 3)
    torch.testing.assert_close(each[0, 0, :, 0], torch.log(torch.exp(torch.tensor([4.0, -4.0])) + 3))
    torch.testing.assert_close(each[0, 0, :, 1], torch.full((2,), 1 + math.log(2)))
    assert (each[..., 2] == float("-inf")).all()
    mean = reference_step.outlier_log_mass(outliers, units, query, 1.0, each=False)
    torch.testing.assert_close(mean[0, 0, 0, 0], torch.tensor(math.log(4.0)))


def _reference_parts(state, query: torch.Tensor, scale: float, block: int, fixed: bool = False) -> torch.Tensor:
    """``(4, B, H * G, blocks)``: the blocks kernel's parts as the reference's unit log masses give them
    (``trigger.leaving == "ignored"``; ``fixed``: the query in fixed point): the best candidate, the held units
    counted, their largest log mass and the exp-sum below it, a block of ``block`` units each."""
    units = state.layer.units
    log_mass = reference_step.outlier_log_mass(state.outliers, units, query, scale, each=True, fixed=fixed)
    batch, heads, per_head, count = log_mass.shape
    held = torch.zeros(batch, heads, count + 1, dtype=torch.bool, device=log_mass.device)
    held.scatter_(2, state.held.clamp(min=-1).where(state.held >= 0, count), True)
    held = held[..., :count].unsqueeze(2).expand_as(log_mass)
    ids = torch.arange(count, device=log_mass.device)
    opened = ids.view(1, -1) >= (units.num_prompt_units + state.units_at_selection).view(-1, 1)
    finite = log_mass > float("-inf")
    candidate = ~held & finite & ~opened.view(batch, 1, 1, count)
    counted = held & finite
    pad = -count % block

    def blocks(t, fill):
        return torch.nn.functional.pad(t, (0, pad), value=fill).reshape(batch, heads * per_head, -1, block)

    best = blocks(log_mass.where(candidate, float("-inf")), float("-inf")).amax(-1)
    held_count = blocks(counted.float(), 0.0).sum(-1)
    top = blocks(log_mass.where(counted, float("-inf")), float("-inf")).amax(-1)
    shift = top.where(top.isfinite(), 0.0)
    total = (blocks(log_mass.where(counted, float("-inf")), float("-inf")) - shift.unsqueeze(-1)).exp().sum(-1)
    return torch.stack([best, held_count, top, total])


# the blocks kernel at a real head dimension (128: 32 to 128 units a block, as a decode step runs it;
# the tests above, at 24, take 256), in each setting benchmarks/outlier_blocks.py times
# (and the shipped settings at SmolLM2's and Gemma 3's head dimensions, 64 and 256)
@pytest.mark.parametrize("dim, tile, stages, warps, product, fixed", [
    (128, 4096, 0, 4, "tf32", False), (128, 4096, 2, 4, "tf32", False), (128, 8192, 0, 4, "tf32", False),
    (128, 8192, 2, 4, "tf32", False), (128, 2048, 0, 4, "tf32", False),
    # (the interpreter ignores ``num_warps``: on the CPU this case is the one at 4 warps)
    pytest.param(128, 4096, 0, 2, "tf32", False, marks=GPU_CROSS),
    (128, 8192, 0, 4, "tf32", True), (64, 8192, 0, 4, "tf32", True),
    pytest.param(128, 8192, 0, 4, "query", False, marks=ON_GPU_ONLY),
    pytest.param(128, 8192, 2, 4, "query", False, marks=ON_GPU_ONLY),
    pytest.param(128, 16384, 0, 8, "query", False, marks=ON_GPU_ONLY),
    pytest.param(64, 8192, 0, 4, "query", False, marks=ON_GPU_ONLY),
    pytest.param(256, 8192, 0, 4, "query", False, marks=ON_GPU_ONLY),
    pytest.param(256, 8192, 0, 4, "query", True, marks=ON_GPU_ONLY),
    pytest.param(128, 16384, 0, 8, "query", True, marks=ON_GPU_ONLY),
    (64, 8192, 0, 4, "tf32", False), (256, 8192, 0, 4, "tf32", False)])
def test_outlier_blocks_parts_match_reference_at_real_head_dims(dim, tile, stages, warps, product, fixed, monkeypatch):
    """Each block's parts (best candidate, held count, held top and exp-sum) for each query head, from
    the fused op, against the reference's unit log masses: which block and row differs, if one does."""
    from kvpolicy.bench.trigger_states import decode_trigger_state
    from kvpolicy.kernels.triton import score_gap_outlier

    monkeypatch.setattr(score_gap_outlier, "_TILE_ELEMENTS", tile)
    monkeypatch.setattr(score_gap_outlier, "_KEY_STAGES", stages)
    monkeypatch.setattr(score_gap_outlier, "_BLOCKS_WARPS", warps)
    monkeypatch.setattr(score_gap_outlier, "_KEY_PRODUCT", product)
    monkeypatch.setattr(score_gap_outlier, "_DECIDE_IN_BLOCKS_UP_TO", 0)  # the parts reach the decide launch
    captured = []
    decide = score_gap_outlier.decide_from_parts
    monkeypatch.setattr(score_gap_outlier, "decide_from_parts",
                        lambda trigger, state, parts, *args, **kw: (captured.append(parts.clone()),
                                                                    decide(trigger, state, parts, *args, **kw)))
    gen = torch.Generator(DEVICE).manual_seed(7)
    prompt_units = 4096 if DEVICE.type == "cuda" else 200
    state = decode_trigger_state(gen, batch=2, heads=2, prompt_units=prompt_units, unit_size=16, budget=512,
                                 dim=dim, outliers=4)
    state.outliers.valid[..., 1::3, 2] = False  # some outliers missing
    state.outliers.rest_count[..., ::5] = 0.0  # some units all outliers
    query = torch.randn(2, 8, dim, generator=gen, device=DEVICE).bfloat16()
    trigger = ScoreGap(margin=1e9, measure="mass", leaving="ignored", estimate="outlier", outliers=4, group="each",
                       fixed_query=fixed)
    trigger.validate()
    dispatch.bind("triton", DEVICE).score_gap_outlier_fire(trigger, state, query, dim ** -0.5)
    got = captured[0]
    block = max(16, min(tile // dim, 1 << (state.layer.units.capacity - 1).bit_length()))  # as the launcher's
    want = _reference_parts(state, query, dim ** -0.5, block, fixed)
    for k, what in enumerate(("best candidate", "held count", "held top", "held exp-sum")):
        bad = ~torch.isclose(got[k], want[k], rtol=1e-5, atol=1e-5, equal_nan=True)
        where = bad.nonzero().tolist()[:5]
        assert not bad.any(), (f"{what}: {int(bad.sum())} of {bad.numel()} parts differ, first at (b, row, block) "
                               f"{where}: {[float(got[k][tuple(i)]) for i in where]} != "
                               f"{[float(want[k][tuple(i)]) for i in where]}")



# (the interpreter ignores ``maxnreg``: on the CPU the cap of 80 registers runs as the cap of 64)
@pytest.mark.parametrize("maxnreg, decode_dims", [(64, 16), pytest.param(80, 16, marks=GPU_CROSS), (None, 32),
                                                  (None, 1024)])
def test_outlier_blocks_parts_match_reference_under_a_register_cap(maxnreg, decode_dims, monkeypatch):
    # score_gap_outlier._BLOCKS_MAXNREG (benchmarks/outlier_blocks.py's "maxnreg" variants): the cap makes the
    # compiler spill, which must not change a part; and the decode units' means in tiles of other widths (1024:
    # one product over the head dimension); the query in fixed point, as the preset runs it
    from kvpolicy.kernels.triton import score_gap_outlier

    monkeypatch.setattr(score_gap_outlier, "_BLOCKS_MAXNREG", maxnreg)
    monkeypatch.setattr(score_gap_outlier, "_DECODE_DIMS", decode_dims)
    test_outlier_blocks_parts_match_reference_at_real_head_dims(128, 8192, 0, 4, "tf32", True, monkeypatch)
