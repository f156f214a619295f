"""Triton budget fill against the reference: exactly equal outputs on fresh random inputs.

Rows of sequences outside ``take`` must hold the Triton op's empty selection; every ranking
(the full in-kernel sort, the threshold select, torch.sort, torch.topk and the radix select,
each forced through ``RANKING``, and the default rule) must give the reference's stable
descending order, ties and special values included.

Without CUDA the kernel runs on CPU tensors through Triton's interpreter (conftest turns it
on); with CUDA the same cases run on the GPU, plus decode-sized ones.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gpu_cross import GPU_CROSS, cross

from kvpolicy.kernels import dispatch, reference

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


def _select_budget():
    return dispatch.get("select_budget", "triton", DEVICE)


def _random_units(batch, heads, units, tokens, max_size, seed, p_inf=0.15, p_empty=0.1, levels=None):
    """Scores (ties when ``levels`` is set, some -inf), sizes (some 0), starts and orders."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    shape = (batch, heads, units)
    if levels is None:
        scores = torch.randn(shape, generator=g, device=DEVICE)
    else:
        scores = torch.randint(0, levels, shape, generator=g, device=DEVICE).float()
    scores = scores.masked_fill(torch.rand(shape, generator=g, device=DEVICE) < p_inf, float("-inf"))
    sizes = torch.randint(1, max_size + 1, shape, generator=g, device=DEVICE)
    sizes = sizes.masked_fill(torch.rand(shape, generator=g, device=DEVICE) < p_empty, 0).clamp(max=tokens)
    starts = (torch.rand(shape, generator=g, device=DEVICE) * (tokens - sizes + 1)).long()
    order = torch.argsort(torch.rand(batch, heads, tokens, generator=g, device=DEVICE), dim=-1)
    return scores, sizes, starts, order


RANKINGS = ["auto", "full", "threshold", "torch.sort", "topk", "radix"]


def _use_ranking(name, monkeypatch):
    from kvpolicy.kernels.triton import select

    monkeypatch.setattr(select, "RANKING", name)


def _check(scores, sizes, starts, order, capacity, take=None):
    """Triton equals the reference on the rows of sequences in ``take`` (all when None); the
    other rows hold the documented empty selection, in range."""
    got = _select_budget()(scores, sizes, starts, order, capacity, take)
    want = reference.select_budget(scores, sizes, starts, order, capacity)
    rows = torch.ones(scores.shape[0], dtype=torch.bool, device=DEVICE) if take is None else take
    for name, a, b in zip(("unit_ids", "num_units", "slots", "slot_valid"), got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a[rows], b[rows]), name
    unit_ids, num_units, slots, slot_valid = (t[~rows] for t in got)
    assert (slots == 0).all() and not slot_valid.any() and (num_units == 0).all() and (unit_ids == -1).all()
    return got


@pytest.mark.parametrize(
    "batch, heads, units, tokens, max_size, capacity, levels, block",
    [
        (2, 3, 40, 300, 12, 64, None, None),  # budget cut inside a unit
        (1, 2, 30, 200, 9, 1000, None, None),  # budget larger than all tokens
        (2, 2, 50, 400, 8, 37, 3, None),  # many ties
        (1, 1, 12, 500, 400, 100, None, None),  # units larger than the budget
        # 1,500 units: one full sort of 2,048 keys a row, ~7 s each under the interpreter: on the GPU
        pytest.param(2, 2, 1500, 4000, 6, 1100, 50, None, marks=GPU_CROSS),
        (2, 2, 250, 700, 6, 180, 50, 64),  # several blocks of units and of positions (blocks of 64)
    ],
)
def test_select_budget_matches_reference(batch, heads, units, tokens, max_size, capacity, levels, block,
                                         monkeypatch):
    from kvpolicy.kernels.triton import select

    if block is not None:
        monkeypatch.setattr(select, "_BLOCK", block)
    seed = units * 7 + capacity
    _check(*_random_units(batch, heads, units, tokens, max_size, seed, levels=levels), capacity)


def test_a_large_top_unit_fills_the_whole_budget():
    scores = torch.tensor([[[0.5, 3.0, 1.0]]], device=DEVICE)
    sizes = torch.tensor([[[4, 50, 4]]], device=DEVICE)
    starts = torch.tensor([[[0, 4, 54]]], device=DEVICE)
    order = torch.arange(58, device=DEVICE).flip(0).view(1, 1, 58)
    unit_ids, num_units, slots, valid = _check(scores, sizes, starts, order, 16)
    assert unit_ids.tolist() == [[[1, -1, -1]]] and num_units.item() == 1
    assert valid.all() and slots.tolist() == [[list(range(53, 37, -1))]]


def test_nothing_selectable_leaves_an_empty_budget():
    scores = torch.full((2, 1, 5), float("-inf"), device=DEVICE)
    sizes = torch.full((2, 1, 5), 3, device=DEVICE)
    starts = torch.arange(0, 15, 3, device=DEVICE).expand(2, 1, 5)
    order = torch.arange(15, device=DEVICE).expand(2, 1, 15)
    unit_ids, num_units, _, valid = _check(scores, sizes, starts, order, 8)
    assert (unit_ids == -1).all() and (num_units == 0).all() and not valid.any()


def test_zero_capacity_and_nan_scores():
    scores, sizes, starts, order = _random_units(1, 2, 20, 100, 5, seed=5)
    scores[0, 0, :3] = float("nan")  # sorts first, never selectable (as in the reference)
    _check(scores, sizes, starts, order, 0)
    _check(scores, sizes, starts, order, 25)


def test_dispatch_reaches_the_triton_op():
    from kvpolicy.kernels.triton import select

    assert dispatch.why_unavailable("triton", "select_budget", DEVICE) is None
    assert dispatch.get("select_budget", "triton", DEVICE) is select.select_budget


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    units=st.integers(1, 70),
    max_size=st.integers(1, 40),
    capacity=st.integers(0, 300),
    levels=st.sampled_from([None, 2, 5]),
    take_bits=st.integers(0, 7),
    seed=st.integers(0, 2**31 - 1),
)
def test_select_budget_property(batch, heads, units, max_size, capacity, levels, take_bits, seed):
    take = None if take_bits == 7 else torch.tensor([bool(take_bits >> b & 1) for b in range(batch)], device=DEVICE)
    _check(*_random_units(batch, heads, units, 600, max_size, seed, levels=levels), capacity, take)


# ---- take: sequences that do not re-select ------------------------------------------------

@pytest.mark.parametrize("ranking", RANKINGS)
def test_rows_without_take_get_an_empty_selection(ranking, monkeypatch):
    _use_ranking(ranking, monkeypatch)
    inputs = _random_units(3, 2, 50, 400, 8, seed=3, levels=4)
    _check(*inputs, 37, torch.tensor([True, False, True], device=DEVICE))
    _check(*inputs, 37, torch.tensor([False, False, False], device=DEVICE))
    _check(*inputs, 37, torch.tensor([True, True, True], device=DEVICE))
    _check(*inputs, 0, torch.tensor([False, True, False], device=DEVICE))


def test_take_must_have_one_entry_per_sequence():
    inputs = _random_units(2, 2, 10, 100, 5, seed=4)
    with pytest.raises(ValueError, match="take"):
        _select_budget()(*inputs, 8, torch.ones(3, dtype=torch.bool, device=DEVICE))


# ---- the in-kernel ranking: the order of torch.sort(descending=True, stable=True) -----------

def _special_scores(batch, heads, units, seed):
    """Quantised scores with -0.0 next to 0.0, +-inf, NaN, float extremes and denormals."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 3.4028235e38, -3.4028235e38,
         1e-45, -1e-45, 1.1754944e-38, 1.0, -1.0, 2.0, -2.0, 0.5],
        device=DEVICE,
    )
    pick = torch.randint(0, specials.numel(), (batch, heads, units), generator=g, device=DEVICE)
    return specials[pick]


# every ranking at the two one-block sizes; at 300 units (several blocks: full sorts of 512 keys, about
# 2 s each under the interpreter) every ranking but "auto" (which picks "full" there, as at any size up
# to 2,048 units) with the cut late, and all but "full" with it early; the rest on the GPU
@pytest.mark.parametrize("units, capacity, block, ranking", cross(
    [(7, 20, None), (64, 100, None), (300, 250, 64), (300, 40, 64)], RANKINGS,
    on_cpu=[(s, r) for s in (0, 1) for r in range(6)] + [(2, r) for r in range(1, 6)] + [(3, r) for r in range(2, 6)]))
def test_ranking_of_special_scores_and_ties(units, capacity, block, ranking, monkeypatch):
    from kvpolicy.kernels.triton import select

    _use_ranking(ranking, monkeypatch)
    if block is not None:  # several blocks of units and of positions, several radix chunks
        monkeypatch.setattr(select, "_BLOCK", block)
        monkeypatch.setattr(select, "_THRESHOLD_BLOCK", block)
        monkeypatch.setattr(select, "_RADIX_CHUNK", block)
    _, sizes, starts, order = _random_units(2, 2, units, 3 * units, 4, seed=units, p_empty=0.2)
    scores = _special_scores(2, 2, units, seed=units + 1)
    _check(scores, sizes, starts, order, capacity, torch.tensor([True, False], device=DEVICE))
    _check(scores, sizes, starts, order, capacity)


def test_descending_key_orders_like_a_stable_descending_sort():
    from kvpolicy.kernels.triton import select

    # one row of special and quantised scores: every selectable unit's rank must match
    units = 1024
    scores = _special_scores(1, 1, units, seed=11)
    scores[..., ::3] = torch.randint(-3, 4, (1, 1, len(range(0, units, 3))), device=DEVICE).float() / 4
    sizes = torch.ones(1, 1, units, dtype=torch.long, device=DEVICE)
    starts = torch.arange(units, device=DEVICE).view(1, 1, -1)
    order = torch.arange(units, device=DEVICE).view(1, 1, -1)
    unit_ids, num_units, _, _ = _check(scores, sizes, starts, order, units)
    ranked = torch.sort(scores[0, 0], descending=True, stable=True).indices
    selectable = scores[0, 0][ranked] > float("-inf")
    assert unit_ids[0, 0, : int(num_units)].tolist() == ranked[selectable].tolist()
    assert select.RANKING == "auto" and select.auto_ranking(units, take_inline=False) == "full"  # the kernel ranked it


# the auto rule's limits lowered so the interpreter stays quick (full sorts up to 128 units
# without take and 256 with take, the radix select above)
_SMALL_AUTO_RANKING = ((128, "full", "full"), (256, "full", "radix"), (None, "radix", "radix"))
# ... and a quarter of those, with a quarter of the blocks, radix chunks, tokens and budget: the
# interpreter's full sort of a 256-key block takes about a second a row, of a 64-key block a tenth.
# The limits at their first lowering run on the GPU
_TINY_AUTO_RANKING = ((32, "full", "full"), (64, "full", "radix"), (None, "radix", "radix"))
_LOWERED_LIMITS = [  # (table, block, radix chunk, tokens, capacity, the limit)
    pytest.param(_SMALL_AUTO_RANKING, 32, 32, 1000, 150, 256, marks=GPU_CROSS, id="limit256"),
    pytest.param(_TINY_AUTO_RANKING, 8, 8, 250, 40, 64, id="limit64"),
]


@pytest.mark.parametrize("table, block, chunk, tokens, capacity, limit", _LOWERED_LIMITS)
@pytest.mark.parametrize("above", [-1, 0, 1], ids=["below", "at", "above"])
def test_select_budget_around_the_full_sort_limit(above, table, block, chunk, tokens, capacity, limit, monkeypatch):
    # a padded block, a full one, and the radix select just above (units = limit - 1, limit,
    # limit + 1); small blocks and radix chunks so every walk takes several steps (limit + 1: a
    # last chunk of one unit)
    from kvpolicy.kernels.triton import select

    units = limit + above
    monkeypatch.setattr(select, "AUTO_RANKING", table)
    monkeypatch.setattr(select, "_BLOCK", block)
    monkeypatch.setattr(select, "_RADIX_CHUNK", chunk)
    assert select.auto_ranking(units, take_inline=True) == ("full" if above <= 0 else "radix")
    assert units % chunk == (1 if above > 0 else 0 if above == 0 else chunk - 1)
    inputs = _random_units(2, 2, units, tokens, 4, seed=units, levels=20)
    _check(*inputs, capacity, torch.tensor([False, True], device=DEVICE))
    _check(*inputs, capacity)


def _count_library_rankings(monkeypatch):
    """A list that grows by "sort" / "topk" at each torch.sort / torch.topk call from now on."""
    calls = []
    real_sort, real_topk = torch.sort, torch.topk
    monkeypatch.setattr(torch, "sort", lambda *a, **k: calls.append("sort") or real_sort(*a, **k))
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append("topk") or real_topk(*a, **k))
    return calls


@pytest.mark.parametrize("table, block, chunk, tokens, capacity, limit", _LOWERED_LIMITS)
@pytest.mark.parametrize("units_past", [0, 1, "both"], ids=["first-limit", "past-first", "past-both"])
def test_auto_never_calls_a_library_ranking(units_past, table, block, chunk, tokens, capacity, limit, monkeypatch):
    # with take inline, without take and inside a conditional node's body (only re-selecting
    # steps run it), below and above the lowered limits (the first limit's units, one more, one
    # more than the second's): the kernels rank (only the Triton op's calls count)
    from kvpolicy import graph_branch
    from kvpolicy.kernels.triton import select

    units = limit + 1 if units_past == "both" else limit // 2 + units_past
    monkeypatch.setattr(select, "AUTO_RANKING", table)
    monkeypatch.setattr(select, "_BLOCK", block)
    monkeypatch.setattr(select, "_RADIX_CHUNK", 2 * chunk)
    inputs = _random_units(2, 2, units, tokens, 4, seed=units, levels=20)
    want = reference.select_budget(*inputs, capacity)
    calls = _count_library_rankings(monkeypatch)
    for take in (torch.tensor([True, True], device=DEVICE), None):
        got = _select_budget()(*inputs, capacity, take)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    monkeypatch.setattr(graph_branch, "in_conditional_body", lambda: True)
    got = _select_budget()(*inputs, capacity, torch.tensor([True, False], device=DEVICE))
    assert all(torch.equal(a[:1], b[:1]) for a, b in zip(got, want))
    assert calls == []


def test_auto_follows_its_table(monkeypatch):
    # a table whose rows call library rankings shows which row and column each call took
    from kvpolicy import graph_branch
    from kvpolicy.kernels.triton import select

    monkeypatch.setattr(select, "AUTO_RANKING", ((64, "full", "topk"), (None, "radix", "torch.sort")))
    take = torch.tensor([True, True], device=DEVICE)
    cases = [(_random_units(2, 2, units, 1000, 4, seed=units, levels=20), without) for units, without in
             ((64, ["topk"]), (65, ["sort"]))]
    wants = [reference.select_budget(*inputs, 150) for inputs, _ in cases]
    calls = _count_library_rankings(monkeypatch)
    for (inputs, without), want in zip(cases, wants):
        for rows, expected in ((take, []), (None, without)):
            del calls[:]
            got = _select_budget()(*inputs, 150, rows)
            assert calls == expected and all(torch.equal(a, b) for a, b in zip(got, want))
        monkeypatch.setattr(graph_branch, "in_conditional_body", lambda: True)
        del calls[:]
        _select_budget()(*inputs, 150, take)
        assert calls == without
        monkeypatch.setattr(graph_branch, "in_conditional_body", lambda: False)
    assert select.auto_ranking(64, take_inline=True) == "full" and select.auto_ranking(10**6, False) == "torch.sort"


def test_the_auto_table_names_rankings_and_covers_every_unit_count():
    from kvpolicy.kernels.triton import select

    limits = [limit for limit, _, _ in select.AUTO_RANKING]
    assert limits[-1] is None and limits[:-1] == sorted(limits[:-1])
    assert all(name in select.RANKINGS for _, *names in select.AUTO_RANKING for name in names)


def test_an_unknown_ranking_is_refused(monkeypatch):
    from kvpolicy.kernels.triton import select

    monkeypatch.setattr(select, "RANKING", "bogus")
    with pytest.raises(ValueError, match="accepted: auto, full, threshold, torch.sort"):
        _select_budget()(*_random_units(1, 1, 8, 50, 3, seed=1), 10)


@pytest.mark.parametrize("ranking, units, tokens, capacity, block, chunk", [
    # 2,049 units at the default blocks (5 of 512 for the threshold select), on the GPU: the
    # interpreter's sort of the 4,096-key block a budget above 2,048 needs takes ~15 s a row
    pytest.param("threshold", 2049, 40000, 700, None, None, marks=GPU_CROSS),
    pytest.param("threshold", 2049, 40000, 40000, None, None, marks=GPU_CROSS),
    pytest.param("threshold", 2049, 40000, 90000, None, None, marks=GPU_CROSS),
    pytest.param("radix", 2049, 40000, 700, None, None, marks=GPU_CROSS),
    # the same at an eighth: 257 units over 9 threshold blocks of 32, radix chunks of 128
    ("threshold", 257, 5000, 90, 32, 128),
    ("threshold", 257, 5000, 5000, 32, 128),
    ("threshold", 257, 5000, 11250, 32, 128),
    ("radix", 257, 5000, 90, 32, 128),
])
def test_threshold_select_past_many_blocks(ranking, units, tokens, capacity, block, chunk, monkeypatch):
    # the budget cut mid-ranking (a fifth of the tokens), and a budget of more tokens than all
    # units hold (every unit taken: as many as the positions, and more); for the radix select three
    # chunks, the last of one unit
    from kvpolicy.kernels.triton import select

    _use_ranking(ranking, monkeypatch)
    if block is not None:
        monkeypatch.setattr(select, "_THRESHOLD_BLOCK", block)
        monkeypatch.setattr(select, "_RADIX_CHUNK", chunk)
    assert units % (chunk or select._RADIX_CHUNK) == 1 and units > 4 * (block or select._THRESHOLD_BLOCK)
    inputs = _random_units(2, 1, units, tokens, 3, seed=units, levels=200)
    _check(*inputs, capacity, torch.tensor([True, False], device=DEVICE))
    _check(*inputs, capacity)


@pytest.mark.parametrize("ranking", ["threshold", "radix"])
def test_threshold_select_keeps_better_units_behind_many_ties(ranking, monkeypatch):
    # 250 one-token units tie at the cut, the 50 better ones come after them by index: the
    # candidates must hold every better unit and the first ties, not the first units by index
    from kvpolicy.kernels.triton import select

    _use_ranking(ranking, monkeypatch)
    monkeypatch.setattr(select, "_RADIX_CHUNK", 16)  # ties over many chunks
    units, capacity = 300, 64
    scores = torch.ones(1, 1, units, device=DEVICE)
    scores[..., 250:] = 2.0
    sizes = torch.ones(1, 1, units, dtype=torch.int32, device=DEVICE)
    starts = torch.arange(units, dtype=torch.int32, device=DEVICE).view(1, 1, units)
    order = torch.arange(units, device=DEVICE).view(1, 1, units)
    unit_ids = _check(scores, sizes, starts, order, capacity)[0]
    assert unit_ids[0, 0, :50].tolist() == list(range(250, 300)) and unit_ids[0, 0, 50:64].tolist() == list(range(14))


# ---- the radix select: digits below the top bits, ties over chunks, both sort blocks ---------

def _close_scores(batch, heads, units, low_bits, seed):
    """Scores whose float bits differ only in their ``low_bits`` lowest bits (both signs, ties
    among them), so that the radix select's later passes pick the cut."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    bits = 0x3F800000 + torch.randint(0, 2**low_bits, (batch, heads, units), generator=g, device=DEVICE)
    scores = bits.to(torch.int32).view(torch.float32)
    return torch.where(torch.rand(scores.shape, generator=g, device=DEVICE) < 0.3, -scores, scores)


@pytest.mark.parametrize("low_bits", [8, 9, 20, 21])
def test_radix_select_when_later_digits_decide(low_bits, monkeypatch):
    # 8: only the last pass's 8 bits differ (many ties); 9 / 20: the middle pass's too;
    # 21: the first pass's lowest bit too
    from kvpolicy.kernels.triton import select

    _use_ranking("radix", monkeypatch)
    monkeypatch.setattr(select, "_RADIX_CHUNK", 32)
    _, sizes, starts, order = _random_units(2, 1, 240, 1000, 5, seed=low_bits, p_empty=0.1)
    scores = _close_scores(2, 1, 240, low_bits, seed=low_bits + 1)
    _check(scores, sizes, starts, order, 1)
    _check(scores, sizes, starts, order, 97, torch.tensor([True, False], device=DEVICE))
    _check(scores, sizes, starts, order, 250)


def test_radix_select_cut_exactly_at_a_unit_edge(monkeypatch):
    # one-token units: the budget ends exactly at a unit's last token, never inside one
    from kvpolicy.kernels.triton import select

    _use_ranking("radix", monkeypatch)
    monkeypatch.setattr(select, "_RADIX_CHUNK", 16)
    scores, _, _, _ = _random_units(1, 2, 100, 100, 1, seed=8, p_inf=0.1)
    sizes = torch.ones(1, 2, 100, dtype=torch.long, device=DEVICE)
    starts = torch.arange(100, device=DEVICE).expand(1, 2, 100).contiguous()
    order = torch.arange(100, device=DEVICE).flip(0).expand(1, 2, 100).contiguous()
    for capacity in (1, 2, 63, 64, 65, 89, 90, 91):
        _check(scores, sizes, starts, order, capacity)


def test_radix_select_sorts_many_winners_in_each_block(monkeypatch):
    # the small and middle sort blocks lowered to 8 and 32: budgets whose better-than-cut units
    # fit the small one, the middle one, and neither (then the min(U, R) block sorts them);
    # 1,000 is more than all tokens
    from kvpolicy.kernels.triton import select

    _use_ranking("radix", monkeypatch)
    monkeypatch.setattr(select, "_RADIX_CHUNK", 32)
    monkeypatch.setattr(select, "_RADIX_SMALL_SORT", 8)
    monkeypatch.setattr(select, "_RADIX_MID_SORT", 32)
    inputs = _random_units(2, 2, 200, 800, 3, seed=9, levels=40)
    for capacity in (5, 12, 60, 300, 1000):
        _check(*inputs, capacity, torch.tensor([False, True], device=DEVICE))


@pytest.mark.parametrize("levels, capacity", [(None, 90), (None, 5000), (6, 90), (None, 0)])
def test_radix_select_compacts_only_the_winners(levels, capacity, monkeypatch):
    # the fill's outputs cannot tell a loose cut (more candidates than needed, more to sort)
    # from the exact one: the winner counts can. Better than the cut: the taken units scoring
    # above the unit that holds the R-th token (all taken units when the row holds fewer than R
    # tokens); tied: every non-empty selectable unit scoring exactly as that unit
    from kvpolicy.kernels.triton import select

    monkeypatch.setattr(select, "_RADIX_CHUNK", 16)
    scores, sizes, starts, order = _random_units(3, 2, 150, 2000, 9, seed=31, levels=levels)
    flat_scores, flat_sizes = scores.reshape(6, 150).contiguous(), sizes.reshape(6, 150).contiguous()
    cand_block = 1 << max(0, min(150, capacity) - 1).bit_length()
    unit_ids = torch.empty(6, 150, dtype=torch.long, device=DEVICE)
    _, _, line, state = select._radix_select(flat_scores, flat_sizes, None, capacity, 1, cand_block, unit_ids)
    assert (unit_ids == -1).all()
    want_ids, want_count = reference.select_budget(scores, sizes, starts, order, capacity)[:2]
    live = (flat_scores > float("-inf")) & (flat_sizes > 0)
    for row in range(6):
        taken = want_ids.reshape(6, 150)[row, : int(want_count.reshape(6)[row])]
        better, tied = int(line[row, select._RADIX_COUNTER.value]), int(state[row, 8])
        if int(flat_sizes[row][live[row]].sum()) < capacity:
            assert (better, tied) == (taken.numel(), 0)
        elif capacity == 0:  # no unit holds a 0th token
            assert (better, tied) == (0, 0)
        else:
            cut = flat_scores[row, taken[-1]]
            assert better == int((flat_scores[row, taken] > cut).sum())
            assert tied == int((live[row] & (flat_scores[row] == cut)).sum())


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 2),
    heads=st.integers(1, 2),
    units=st.integers(1, 90),
    max_size=st.integers(1, 30),
    capacity=st.integers(0, 200),
    kind=st.sampled_from(["normal", "levels", "special", "close"]),
    chunk=st.sampled_from([1, 8, 16]),
    take_bits=st.integers(0, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_radix_select_property(batch, heads, units, max_size, capacity, kind, chunk, take_bits, seed):
    # monkeypatch is function-scoped: hypothesis reruns the body, so patch and restore here
    from kvpolicy.kernels.triton import select

    saved = select.RANKING, select._RADIX_CHUNK
    select.RANKING, select._RADIX_CHUNK = "radix", chunk
    try:
        take = None if take_bits == 3 else torch.tensor([bool(take_bits >> b & 1) for b in range(batch)],
                                                        device=DEVICE)
        scores, sizes, starts, order = _random_units(batch, heads, units, 600, max_size, seed,
                                                     levels=3 if kind == "levels" else None)
        if kind == "special":
            scores = _special_scores(batch, heads, units, seed + 1)
        elif kind == "close":
            scores = _close_scores(batch, heads, units, 9, seed + 1)
        _check(scores, sizes, starts, order, capacity, take)
    finally:
        select.RANKING, select._RADIX_CHUNK = saved


# ---- CUDA only: decode-sized problems --------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("ranking", ["auto", "radix"])
@pytest.mark.parametrize("levels", [None, 20])
@pytest.mark.parametrize("max_size", [1, 16, 64])
def test_select_budget_at_decode_sizes(levels, max_size, ranking, monkeypatch):
    _use_ranking(ranking, monkeypatch)
    inputs = _random_units(4, 8, 8192, 131072, max_size, seed=max_size, levels=levels)
    _check(*inputs, 2048)
    _check(*inputs, 4096)
    _check(*inputs, 2048, torch.tensor([True, False, True, False], device=DEVICE))


@needs_cuda
@pytest.mark.parametrize("ranking", ["threshold", "radix"])
@pytest.mark.parametrize("units", [16400, 40000])
def test_threshold_select_at_long_context_unit_counts(units, ranking, monkeypatch):
    _use_ranking(ranking, monkeypatch)
    inputs = _random_units(2, 8, units, 600000, 16, seed=units, levels=None)
    _check(*inputs, 2048)
    _check(*inputs, 2048, torch.tensor([False, True], device=DEVICE))


@needs_cuda
@pytest.mark.parametrize("units", [8192, 16384, 30000])
def test_select_budget_with_take_at_decode_sizes(units):
    inputs = _random_units(4, 8, units, 131072, 16, seed=units, levels=100)
    _check(*inputs, 2048, torch.tensor([True, False, False, True], device=DEVICE))


@needs_cuda
@pytest.mark.parametrize("ranking", ["auto", "radix"])
@pytest.mark.parametrize("units", [8192, 30000])
def test_select_budget_with_take_replays_in_a_cuda_graph(units, ranking, monkeypatch):
    _use_ranking(ranking, monkeypatch)
    scores, sizes, starts, order = _random_units(4, 8, units, 65536, 16, seed=1)
    take = torch.tensor([True, True, False, True], device=DEVICE)
    fill = _select_budget()
    fill(scores, sizes, starts, order, 2048, take)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fill(scores, sizes, starts, order, 2048, take)
    for seed, rows in ((2, [False, True, True, False]), (3, [True, True, True, True]), (4, [False] * 4)):
        for dst, src in zip((scores, sizes, starts, order), _random_units(4, 8, units, 65536, 16, seed=seed)):
            dst.copy_(src)
        take.copy_(torch.tensor(rows, device=DEVICE))
        graph.replay()
        want = reference.select_budget(scores, sizes, starts, order, 2048)
        for a, b in zip(outs, want):
            assert torch.equal(a[take], b[take])
        unit_ids, num_units, slots, valid = (t[~take] for t in outs)
        assert (slots == 0).all() and not valid.any() and (num_units == 0).all() and (unit_ids == -1).all()


@needs_cuda
@pytest.mark.parametrize("ranking", ["auto", "radix"])
def test_select_budget_replays_in_a_cuda_graph(ranking, monkeypatch):
    _use_ranking(ranking, monkeypatch)
    scores, sizes, starts, order = _random_units(4, 8, 8192, 65536, 16, seed=1)
    fill = _select_budget()
    fill(scores, sizes, starts, order, 2048)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fill(scores, sizes, starts, order, 2048)
    fresh = _random_units(4, 8, 8192, 65536, 16, seed=2)
    for dst, src in zip((scores, sizes, starts, order), fresh):
        dst.copy_(src)
    graph.replay()
    want = reference.select_budget(scores, sizes, starts, order, 2048)
    for a, b in zip(outs, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("levels", [None, 3])
def test_radix_winners_of_one_or_two_tokens(levels, monkeypatch):
    # K-means units of random keys: the best-scoring units are the smallest, so hundreds of
    # units beat the cut, more than the small sort block
    _use_ranking("radix", monkeypatch)
    inputs = _random_units(2, 2, 400, 1200, 2, seed=17, levels=levels)
    _check(*inputs, 300)
    _check(*inputs, 300, torch.tensor([False, True], device=DEVICE))

