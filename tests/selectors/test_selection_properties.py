"""Property tests of selection: never over budget, group-consistent, only existing tokens."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpolicy.kernels import reference
from kvpolicy.selectors import Bound, TopBudget
from kvpolicy.units import KMeans, Pages, Segments
from kvpolicy.units.table import UnitTable

from every_preset import PROPERTY_DECODE_UNITS, PROPERTY_PROMPT_UNITS, PROPERTY_SELECTORS


@st.composite
def unit_tables(draw):
    batch = draw(st.integers(1, 2))
    kv_heads = draw(st.integers(1, 3))
    group = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([4, 8]))
    n = draw(st.integers(0, 80))
    decode_tokens = draw(st.integers(0, 40))
    builder = draw(st.sampled_from(PROPERTY_PROMPT_UNITS))
    decode_builder = draw(st.sampled_from(PROPERTY_DECODE_UNITS))
    seed = draw(st.integers(0, 2**16))
    capacity = draw(st.integers(1, 120))
    return batch, kv_heads, group, dim, n, decode_tokens, builder, decode_builder, seed, capacity


def _build(batch, kv_heads, dim, n, decode_tokens, builder, decode_builder, seed):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, kv_heads, n, dim, generator=gen)
    valid = torch.rand(batch, n, generator=gen) > 0.2
    prompt_builder = Pages(size=7) if builder == "pages" else KMeans(tokens_per_cluster=5, iters=3)
    if n:
        labels, units = prompt_builder.build_labels(keys, valid, "reference")
    else:
        labels, units = torch.zeros(batch, kv_heads, 0, dtype=torch.long), 0
    table = UnitTable.from_prompt(keys, torch.arange(n), valid, labels, units)
    decoder = Pages(size=5) if decode_builder == "pages" else Segments(max_size=6)
    existing = set()
    for b in range(batch):
        existing |= {(b, s) for s in range(n) if valid[b, s]}
    # tokens leave the local window in slot order, so a sequence's left padding leaves first
    padding = torch.randint(0, 4, (batch,), generator=gen)
    for i in range(decode_tokens):
        slot = n + i
        token_valid = i >= padding
        boundary = torch.rand(batch, generator=gen) > 0.7
        table.append_leaving_token(torch.tensor(slot), torch.randn(batch, kv_heads, dim, generator=gen), token_valid, boundary,
                                   decoder, "reference")
        existing |= {(b, slot) for b in range(batch) if token_valid[b]}
    return table, existing


@settings(max_examples=60, deadline=None)
@given(unit_tables(), st.sampled_from(PROPERTY_SELECTORS))
def test_selection_respects_budget_groups_and_existing_tokens(case, selector_name):
    batch, kv_heads, group, dim, n, decode_tokens, builder, decode_builder, seed, capacity = case
    table, existing = _build(batch, kv_heads, dim, n, decode_tokens, builder, decode_builder, seed)
    query = torch.randn(batch, kv_heads * group, dim, generator=torch.Generator().manual_seed(seed + 1))
    selector = TopBudget() if selector_name == "top_budget" else Bound()
    selection = selector.select(query, table, capacity, "reference")

    # never over budget; filled exactly unless the selectable tokens run out
    chosen = selection.unit_ids.clamp(min=0)
    chosen_sizes = torch.where(selection.unit_ids >= 0, table.size.gather(2, chosen), 0).sum(-1)
    selectable_tokens = torch.where(table.selectable, table.size, 0).sum(-1)
    filled = selection.slot_valid.sum(-1)
    assert selection.slots.shape == (batch, kv_heads, capacity)
    assert (filled <= capacity).all()
    assert torch.equal(filled, torch.minimum(selectable_tokens, torch.full_like(filled, capacity)))
    # every chosen unit but the last is taken whole
    last = torch.where(selection.num_units > 0, selection.unit_ids.gather(2, (selection.num_units - 1).clamp(min=0).unsqueeze(-1))[..., 0], -1)
    last_size = torch.where(last >= 0, table.size.gather(2, last.clamp(min=0).unsqueeze(-1))[..., 0], 0)
    whole = chosen_sizes - last_size
    some = selection.num_units > 0
    assert (whole[some] < capacity).all()
    assert (filled[some] > whole[some]).all()
    assert (filled[~some] == 0).all()

    # one selection per KV head: the shape has no query-head axis, and the group's heads share it;
    # permuting the query heads inside a group must not change it
    perm = torch.arange(kv_heads * group).view(kv_heads, group).flip(-1).reshape(-1)
    permuted = selector.select(query[:, perm], table, capacity, "reference")
    assert torch.equal(permuted.slots[selection.slot_valid], selection.slots[selection.slot_valid])

    # only existing tokens, each at most once, never padding
    for b in range(batch):
        for h in range(kv_heads):
            slots = selection.slots[b, h][selection.slot_valid[b, h]].tolist()
            assert len(slots) == len(set(slots))
            assert all((b, s) in existing for s in slots)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(1, 50), st.integers(0, 2**16))
def test_budget_fill_takes_best_prefix_that_fits(units, capacity, seed):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(1, 1, units, generator=gen)
    sizes = torch.randint(0, 6, (1, 1, units), generator=gen)
    starts = torch.cumsum(sizes, -1) - sizes
    order = torch.arange(int(sizes.sum()) + 1).view(1, 1, -1)
    ids, count, slots, valid = reference.select_budget(scores, sizes, starts, order, capacity)
    # the sequential rule: whole units in score order, the first that does not fit is cut
    ranked = torch.argsort(scores[0, 0], descending=True, stable=True)
    expected, want = [], []
    for u in ranked.tolist():
        if len(want) >= capacity:
            break
        if sizes[0, 0, u] == 0:
            continue
        expected.append(u)
        tokens = list(range(int(starts[0, 0, u]), int(starts[0, 0, u] + sizes[0, 0, u])))
        want += tokens[: capacity - len(want)]
    assert ids[0, 0, : int(count[0, 0])].tolist() == expected
    assert slots[0, 0][valid[0, 0]].tolist() == want
