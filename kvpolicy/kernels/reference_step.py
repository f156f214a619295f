"""Reference (plain PyTorch) of the decode step's bookkeeping ops, and of the score_gap trigger's.

Each op is one to three launches on a fast backend (``kernels/triton/step.py``; the trigger's in
``kernels/triton/score_gap.py``) where this reference takes ten to sixty small PyTorch kernels:
on a step that keeps its selection these launches are most of what a policy adds to attention,
so they are fused. Everything is in place on fixed buffers, and slots come from device
counters: a captured step replays. The score_gap trigger's measures (``score_gap``,
``mass_gap``) live here with its step.
"""

from __future__ import annotations

import torch

from .fixed_point import fixed_query


def append_token(store, key: torch.Tensor, value: torch.Tensor) -> None:
    """Write one decode token (``key``/``value`` ``(B, H, D)``) at slot ``store.next_slot``.

    The pool row and the local ring's position ``slot % L`` take it, ``slot_valid`` and the
    ring's validity mark it. Before the ring position is overwritten, its token goes to
    ``store.evicted`` (key, value, ``valid`` False while the ring is still filling, and
    ``slot = max(slot - L, 0)``); ``store.current_slot`` gets ``slot``. ``next_slot`` itself is
    not advanced here (the caller does, after every reader of it). A prompt sink token that
    leaves the ring makes its sink row valid and is not handed on (``valid`` False).
    """
    slot = store.next_slot
    evicted, pool, ring, sink = store.evicted, store.pool, store.local, store.sink
    store.current_slot.copy_(slot)
    pool.keys.index_copy_(2, slot.view(1).to(pool.keys.device), key.unsqueeze(2).to(pool.keys.device, pool.keys.dtype))
    pool.values.index_copy_(2, slot.view(1).to(pool.values.device),
                            value.unsqueeze(2).to(pool.values.device, pool.values.dtype))
    pool.valid.index_fill_(1, slot.view(1), True)
    capacity = ring.rows
    position = (slot % capacity).view(1)
    evicted.slot.copy_((slot - capacity).clamp(min=0))
    evicted.key.copy_(ring.keys.index_select(2, position).squeeze(2))
    evicted.value.copy_(ring.values.index_select(2, position).squeeze(2))
    leaving = ring.valid[:, 0].index_select(1, position).squeeze(1) & (slot >= capacity)
    # a sink token leaving the ring: its sink row becomes valid, and it is not retrieved as well
    to_sink = (sink.slots == evicted.slot) & ~sink.valid[:, 0] & leaving[:, None]  # (B, S)
    sink.valid.logical_or_(to_sink[:, None, :])
    evicted.valid.copy_(leaving & ~to_sink.any(-1))
    ring.keys.index_copy_(2, position, key.unsqueeze(2).to(ring.keys.dtype))
    ring.values.index_copy_(2, position, value.unsqueeze(2).to(ring.values.dtype))
    ring.valid.index_fill_(2, position, True)


def note_decision(
    fire: torch.Tensor, has_selection: torch.Tensor, reselections: torch.Tensor, boundary: torch.Tensor,
    slot: torch.Tensor, reselect: torch.Tensor,
) -> None:
    """The step's decision from the trigger's ``fire (B,)``: ``reselect = fire | ~has_selection``
    (the first step selects unless the prompt did), written into ``reselect`` and or-ed into
    ``boundary[:, slot]`` (which a selection from the prompt marked at the first step's slot); then
    ``has_selection`` becomes True and ``reselections`` counts it."""
    decided = fire | ~has_selection
    reselect.copy_(decided)
    at = slot.view(1)
    boundary.index_copy_(1, at, boundary.index_select(1, at) | decided.view(-1, 1))
    has_selection.fill_(True)
    reselections.add_(decided.long())


def query_cosine_fire(
    query: torch.Tensor, previous: torch.Tensor, has_previous: torch.Tensor, tau: float, anchor: bool
) -> torch.Tensor:
    """LouisKV's decision: mean over query heads of cos(q, previous) < ``tau`` (or no previous).

    ``query``/``previous`` ``(B, Hq, D)``; ``previous`` becomes ``query`` (``anchor``: only where
    it fired) and ``has_previous`` True. Returns ``fire (B,)`` bool.
    """
    q = query.float()
    similarity = torch.nn.functional.cosine_similarity(q, previous, dim=-1).mean(dim=-1)
    fire = (similarity < tau) | ~has_previous
    if anchor:
        q = torch.where(fire.view(-1, 1, 1), q, previous)
    previous.copy_(q)
    has_previous.fill_(True)
    return fire


def interval_fire(steps: torch.Tensor, n: int) -> torch.Tensor:
    """Re-select every ``n`` decode steps: ``fire = steps % n == 0``, then ``steps += 1`` (``(B,)`` long)."""
    fire = steps % n == 0
    steps.add_(1)
    return fire


def interval_decision(
    steps: torch.Tensor, n: int, has_selection: torch.Tensor, reselections: torch.Tensor, boundary: torch.Tensor,
    slot: torch.Tensor, reselect: torch.Tensor,
) -> None:
    """``interval_fire`` and ``note_decision`` in one op: the interval trigger's whole step."""
    note_decision(interval_fire(steps, n), has_selection, reselections, boundary, slot, reselect)


def commit_selection(store, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor) -> None:
    """After a fetch wrote the retrieved rows: the buffer's slots, validity, fill and held flags
    for the sequences where ``reselect (B,)``. ``slots``/``slot_valid``: ``(B, H, R)``.

    A slot is attended where the selection lists it and it holds a real token (padding inside a
    unit is fetched, never attended); a row is held (reusable by the next fetch without a pool
    read) where its slot was written already.
    """
    batch, buffer = slots.shape[0], store.retrieved
    valid = slot_valid & store.pool.valid.gather(1, slots.view(batch, -1)).view_as(slots)
    take = reselect.view(-1, 1, 1)
    buffer.valid.copy_(torch.where(take, valid, buffer.valid))
    buffer.slots.copy_(torch.where(take, slots, buffer.slots))
    buffer.fill.copy_(torch.where(take[..., 0], slot_valid.sum(-1), buffer.fill))
    held = (slots >= 0) & (slots < store.next_slot)
    buffer.held.copy_(torch.where(take, held, buffer.held))


def fetch_whole(store, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor) -> None:
    """A fetch that reads every selected row from the pool (``TieredStore.read_whole``): for the
    sequences where ``reselect (B,)``, the retrieved buffer's keys and values become the pool
    rows of ``slots (B, H, R)`` (not where the store ``attends_pool_by_slot``: attention reads
    them from the pool), then ``commit_selection``; ``rows_fetched`` and ``pool_rows_read`` both
    grow by ``H * R``. The other sequences are untouched."""
    from .reference import gather_rows_into

    buffer = store.retrieved
    heads, rows = slots.shape[1:]
    if not store.attends_pool_by_slot:
        pool_rows = store.pool_rows(slots)
        gather_rows_into(store.pool.keys, pool_rows, reselect, buffer.keys)
        gather_rows_into(store.pool.values, pool_rows, reselect, buffer.values)
    commit_selection(store, slots, slot_valid, reselect)
    fetched = reselect.long() * (heads * rows)
    store.rows_fetched.add_(fetched)
    store.pool_rows_read.add_(fetched)


def append_leaving_by_rule(table, slot, key, valid, boundary, max_size: int, at_boundary: bool) -> None:
    """File the token leaving the local window (``slot``: 0-dim; ``key (B, H, D)``; ``valid (B,)``)
    in ``table``, cutting a new unit by the rule of ``UnitBuilder.cut_rule``: when none is open,
    when the open one holds ``max_size`` tokens, or (``at_boundary``) where the trigger fired
    at the step that made the token (``boundary (B, capacity)`` at ``slot``). ``order_next`` is
    not advanced here."""
    from .reference import append_to_unit

    batch, heads, _ = key.shape
    fired = boundary.index_select(1, slot.view(1))[:, 0]
    has_open = table.open_unit >= 0
    index = table.open_unit.clamp(min=0).view(batch, 1, 1).expand(batch, heads, 1)
    open_size = torch.where(has_open, table.size.gather(2, index)[:, 0, 0], 0)
    cut = (open_size == 0) | (open_size >= max_size)
    if at_boundary:
        cut = cut | fired
    append_to_unit(
        table.order, table.start, table.size, table.key_sum, table.key_min, table.key_max, table.key_mean,
        table.selectable,
        table.open_unit, table.decode_units, table.order_next, slot, key, valid, cut & valid,
        table.num_prompt_units,
    )


def open_unit_size(units) -> torch.Tensor:
    """``(B, H)`` the size of each sequence's open decode unit (unit 0's where none is open)."""
    batch, heads = units.size.shape[:2]
    index = units.open_unit.clamp(min=0).view(batch, 1, 1).expand(batch, heads, 1)
    return units.size.gather(2, index)[..., 0]


def held_units_mask(held: torch.Tensor, capacity: int) -> torch.Tensor:
    """``(B, H, capacity)`` bool: True at the unit ids listed in ``held (B, H, K)`` (-1: none)."""
    index = torch.where(held >= 0, held, capacity)  # the -1s go to a spare column that is cut off
    padded = torch.zeros(*held.shape[:-1], capacity + 1, dtype=torch.bool, device=held.device)
    padded.scatter_(-1, index, True)
    return padded[..., :-1]


def score_gap(scores: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``(B, H)``: best unheld unit's score minus the weakest held unit's (``-inf`` where nothing is
    unheld and selectable; ``+inf`` where nothing is held but something could be)."""
    finite = scores > float("-inf")
    best_unheld = scores.masked_fill(held | ~finite, float("-inf")).amax(-1)
    weakest_held = scores.masked_fill(~held | ~finite, float("inf")).amin(-1)
    nothing_held = ~(held & finite).any(-1)
    return torch.where(nothing_held, best_unheld.masked_fill(best_unheld > float("-inf"), float("inf")),
                       best_unheld - weakest_held)


def mass_gap(scores: torch.Tensor, held: torch.Tensor, size: torch.Tensor,
             peak: torch.Tensor | None = None) -> torch.Tensor:
    """``(B, H)``: log of the best unheld unit's estimated attention mass over the held units' mass.

    A unit's mass is estimated as ``size * exp(score)`` (its tokens at its mean key's logit), so
    ``log(size) + score``; ``-inf`` where nothing is unheld, ``+inf`` where nothing is held.
    ``peak`` (optional, ``(B, H, U)`` logits): an unheld unit's mass is estimated as at least
    ``exp(peak)`` (one token at its key bound), so a unit whose mean hides one spiking token counts
    by that token; the held side stays at the mean estimate.
    """
    finite = scores > float("-inf")
    log_mass = scores + torch.log(size.clamp(min=1).float())
    unheld_mass = log_mass if peak is None else torch.maximum(log_mass, peak)
    best_unheld = unheld_mass.masked_fill(held | ~finite, float("-inf")).amax(-1)
    held_mass = torch.logsumexp(log_mass.masked_fill(~held | ~finite, float("-inf")), dim=-1)
    return best_unheld - held_mass


def rank_gap(scores: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """``(B, H)`` float: how many unheld units outscore the held units' mean score (units the
    selector would now rank in the upper part of the selection); ``+inf`` where nothing is held
    but something could be, 0 where nothing is unheld."""
    finite = scores > float("-inf")
    counted = held & finite
    middle = scores.masked_fill(~counted, 0.0).sum(-1, keepdim=True) / counted.sum(-1, keepdim=True).clamp(min=1)
    count = (~held & finite & (scores > middle)).sum(-1).float()
    nothing_held = ~(held & finite).any(-1)
    return torch.where(nothing_held & (~held & finite).any(-1), float("inf"), count)


def follow_leaving_token(state, leaving_unheld: bool, evict: bool) -> None:
    """Bring a ``ScoreGapState``'s ``held`` list up to date with the token that left the local
    window since the last look: the open decode unit took it (the table grew) and the retrieved
    buffer admitted it (its fill grew) or not. ``leaving_unheld``: a held unit that took a token
    the buffer did not admit is dropped; ``evict``: the policy's ``admit="evict"``. In place."""
    units, store = state.layer.units, state.layer.store
    unit = units.open_unit  # (B,)
    size = open_unit_size(units)
    admitted_now = store.admitted
    moved = (unit != state.seen_open).view(-1, 1)
    appended = (unit >= 0).view(-1, 1) & (moved | (size != state.seen_size))  # (B, H)
    admitted = admitted_now > state.seen_admitted
    listed = state.held == unit.view(-1, 1, 1)  # (B, H, R)
    add = appended & admitted & ~listed.any(-1)
    room = state.held.shape[-1]
    position = state.held_count.clamp(max=room - 1).unsqueeze(-1)
    current = state.held.gather(2, position)
    state.held.scatter_(2, position, torch.where(add.unsqueeze(-1), unit.view(-1, 1, 1).expand_as(current), current))
    end_now = state.held_end.gather(2, position)
    state.held_end.scatter_(2, position, torch.where(add.unsqueeze(-1), 0, end_now))
    if evict:
        # selected units whose last rows a leaving token took: rows [kept, ...) are no longer the selection's
        state.held.masked_fill_(state.held_end > store.kept.unsqueeze(-1), -1)
    state.held_count.add_(add.long())
    if leaving_unheld:
        # a token of a held unit that was not admitted: the unit is no longer all attended
        drop = (appended & ~admitted).unsqueeze(-1) & listed
        state.held.masked_fill_(drop, -1)
    state.seen_open.copy_(unit)
    state.seen_size.copy_(size)
    state.seen_admitted.copy_(admitted_now)
    state.held_marks = None  # the Triton ops' marks of the list: made from it again where next read


def score_gap_fire(trigger, state, scores: torch.Tensor, scale: float,
                   bound: torch.Tensor | None = None, *, decision=None) -> torch.Tensor:
    """The score-gap trigger's step (``triggers/score_gap.py``): follow the leaving token, then fire
    ``(B,)`` where, in any KV head, the gap (``trigger.measure``) of ``scores * scale`` (the
    selector's ``(B, H, U)`` unit scores, ``-inf`` where not selectable) exceeds ``trigger.margin``,
    or ``state`` has no selection yet (with ``trigger.follow``: the margin is lowered by it where
    the layer above re-selected; with ``trigger.cap``: also where the selection has been kept for
    ``cap`` steps). ``bound``: ``(B, H, U)`` the units' key-bound scores (Quest's upper bound on a
    token's score), read where ``trigger.estimate == "bound"`` (measure ``mass``: an unheld unit's
    log mass is at least its best token's bound); with ``estimate == "gauss"`` it is the trigger's
    correction to the unit logits instead. ``state.gap`` gets the largest gap, clamped to +-1e4.
    ``decision``: a layer's ``Decision``, written as ``note_decision`` writes it.
    ``estimate="outlier"`` has its own op (``score_gap_outlier_fire``)."""
    layer = state.layer
    follow_leaving_token(state, trigger.leaving == "unheld", layer.policy.admit == "evict")
    now = scores * scale
    if getattr(trigger, "estimate", "mean") == "gauss":
        # each unit's log mean exp(logit) under a Gaussian spread of its keys (``ScoreGap._spread``)
        now = now + bound * scale * scale
    held = held_units_mask(state.held, layer.units.capacity)
    size = layer.units.size
    each = scores.dim() == 4  # (B, H, G, U): each query head's scores (``trigger.group == "each"``)
    if each:
        held, size = held.unsqueeze(2), size.unsqueeze(2)
    now = _without_opened_units(trigger, state, now, held)
    if trigger.measure == "weakest":
        gap = score_gap(now, held)
    elif trigger.measure == "rank":
        gap = rank_gap(now, held)
    else:
        peak = None
        if getattr(trigger, "estimate", "mean") == "bound":
            peak = (bound * scale).masked_fill(now == float("-inf"), float("-inf"))
        gap = mass_gap(now, held, size, peak)
    fire = _fire_on_gap(trigger, state, gap)
    count = getattr(trigger, "count", 0.0)
    if count > 0:
        # also the rank measure's count, against its own threshold
        ranked = rank_gap(now, held)
        if each:
            ranked = ranked.flatten(1)
        fire = fire | (ranked.amax(-1) > count)
    return _count_age_and_note(trigger, state, fire, decision)


def score_gap_outlier_fire(trigger, state, query: torch.Tensor, scale: float, *, decision=None) -> torch.Tensor:
    """``score_gap_fire`` for ``trigger.estimate == "outlier"`` (measure ``mass``), from the query
    ``(B, Hq, D)`` itself: each unit's log attention mass is ``outlier_log_mass``'s, for the query
    group's mean (``trigger.group == "mean"``, the selector's view) or each query head
    (``"each"``: the largest gap over every query head decides). ``scale``: the attention scale."""
    layer = state.layer
    follow_leaving_token(state, trigger.leaving == "unheld", layer.policy.admit == "evict")
    log_mass = outlier_log_mass(state.outliers, layer.units, query, scale, trigger.group == "each",
                                trigger.fixed_query)
    held = held_units_mask(state.held, layer.units.capacity).unsqueeze(2)
    log_mass = _without_opened_units(trigger, state, log_mass, held)
    finite = log_mass > float("-inf")
    unheld = log_mass.masked_fill(held | ~finite, float("-inf"))
    if getattr(trigger, "challengers", 0):
        unheld = _challenged(trigger, state, unheld)
    if getattr(trigger, "low_rank", 0):
        unheld = _first_pass(trigger, state, query, scale, unheld)
    best_unheld = unheld.amax(-1)
    held_mass = torch.logsumexp(log_mass.masked_fill(~held | ~finite, float("-inf")), dim=-1)
    fire = _fire_on_gap(trigger, state, best_unheld - held_mass)
    return _count_age_and_note(trigger, state, fire, decision)


def _challenged(trigger, state, unheld: torch.Tensor) -> torch.Tensor:
    """``unheld (B, H, G, U)`` (``-inf`` where held) as this step competes (``ScoreGap.challengers``):
    whole on a measured step, which also keeps its ``trigger.challengers`` strongest units in
    ``state.challengers``; on the steps between, only those units. A sequence with no challenger left
    (none kept yet, or a selection took one) measures whole too, so a re-selection does not leave the
    steps after it watching the units it now holds."""
    count = min(trigger.challengers, unheld.shape[-1])
    if state.challengers is None or state.challengers.shape[:-1] != unheld.shape[:-1]:
        state.challengers = torch.full((*unheld.shape[:-1], count), -1, dtype=torch.long, device=unheld.device)
    ids = state.challengers
    listed = ids >= 0
    still_unheld = unheld.gather(-1, ids.clamp(min=0)) > float("-inf")
    stale = (listed & ~still_unheld).flatten(1).any(-1) | ~listed.flatten(1).any(-1)  # (B,)
    measured = ((state.steps + state.layer.layer_idx) % trigger.every == 0) | stale
    measured = measured.view(-1, 1, 1, 1)
    strongest = unheld.topk(count, dim=-1)
    ids.copy_(torch.where(measured, strongest.indices.masked_fill(strongest.values == float("-inf"), -1), ids))
    kept = torch.zeros_like(unheld, dtype=torch.bool).scatter_(-1, ids.clamp(min=0), ids >= 0)
    return torch.where(measured, unheld, unheld.masked_fill(~kept, float("-inf")))


def _first_pass(trigger, state, query: torch.Tensor, scale: float, unheld: torch.Tensor) -> torch.Tensor:
    """``unheld (B, H, G, U)`` (``-inf`` where held) kept only at each query head's ``trigger.low_rank_top``
    units of largest mass estimated from the query projected on the layer's prompt key basis
    (``ScoreGap.low_rank``): ``q . P P^T k`` is the product of the two projections, so a kernel reads ``low_rank``
    coordinates a key there instead of the key."""
    basis = state.key_basis  # (B, H, D, r)
    batch, q_heads, dim = query.shape
    group = query.float().view(batch, basis.shape[1], q_heads // basis.shape[1], dim)
    projected = torch.einsum("bhgr,bhdr->bhgd", torch.einsum("bhgd,bhdr->bhgr", group, basis), basis)
    approx = outlier_log_mass(state.outliers, state.layer.units, projected.reshape(batch, q_heads, dim), scale,
                              trigger.group == "each", trigger.fixed_query)
    approx = approx.masked_fill(unheld == float("-inf"), float("-inf"))
    strongest = approx.topk(min(trigger.low_rank_top, approx.shape[-1]), dim=-1)
    kept = torch.zeros_like(unheld, dtype=torch.bool).scatter_(-1, strongest.indices, strongest.values > float("-inf"))
    return unheld.masked_fill(~kept, float("-inf"))


def outlier_log_mass(outliers, units, query: torch.Tensor, scale: float, each: bool,
                     fixed: bool = False) -> torch.Tensor:
    """``(B, H, G, U)`` float32: each unit's estimated log attention mass for each query head of
    ``query (B, Hq, D)`` (``G`` of them a KV head; with ``each`` False, ``G`` is 1: the query
    group's mean). A prompt unit's is the logsumexp of its outlier keys' logits and its other
    tokens' (their count times their mean key's: ``outliers``, an ``OutlierKeys``); a decode
    unit's its size times its mean key's (the table's float16 ``key_mean``); ``-inf`` where the
    unit is not selectable. With ``fixed`` (``ScoreGap.fixed_query``), the prompt units' products take
    the query in 14-bit fixed point (``fixed_point.py``)."""
    batch, q_heads, dim = query.shape
    heads = units.size.shape[1]
    group = query.float().view(batch, heads, q_heads // heads, dim)
    if not each:
        group = group.mean(2, keepdim=True)
    log_mass = torch.einsum("bhgd,bhud->bhgu", group, units.key_mean.float()) * scale
    log_mass = log_mass + torch.log(units.size.clamp(min=1).float()).unsqueeze(2)
    prompt = outliers.rest_count.shape[-1]
    if fixed:
        group = fixed_query(group)
    if prompt:
        outlier = torch.einsum("bhgd,bhumd->bhgum", group, outliers.keys.float())
        outlier = outlier * (outliers.key_scale * scale).unsqueeze(2).unsqueeze(-1)
        outlier = outlier.masked_fill(~outliers.valid.unsqueeze(2), float("-inf"))
        rest = torch.einsum("bhgd,bhud->bhgu", group, outliers.rest_mean.float())
        rest = rest * (outliers.rest_scale * scale).unsqueeze(2)
        rest = rest + torch.log(outliers.rest_count).unsqueeze(2)  # -inf where every token is an outlier
        log_mass[..., :prompt] = torch.logsumexp(torch.cat([outlier, rest.unsqueeze(-1)], dim=-1), dim=-1)
    return log_mass.masked_fill(~units.selectable.unsqueeze(2), float("-inf"))


def _without_opened_units(trigger, state, logits: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """With ``trigger.leaving == "ignored"``: ``logits`` (units last) at ``-inf`` for the unheld
    units opened since the selection (the buffer did not admit them: they are no candidates)."""
    if trigger.leaving != "ignored":
        return logits
    first_new = state.layer.units.num_prompt_units + state.units_at_selection  # (B,)
    ids = torch.arange(logits.shape[-1], device=logits.device)
    opened = (ids.view(1, -1) >= first_new.view(-1, 1)).view(-1, *([1] * (logits.dim() - 2)), logits.shape[-1])
    return logits.masked_fill(opened & ~held, float("-inf"))


def _fire_on_gap(trigger, state, gap: torch.Tensor) -> torch.Tensor:
    """``(B,)``: the largest of ``gap`` (a KV head's, or a query head's, per sequence) over
    ``trigger``'s margin for this layer, or no selection yet, or (``follow``) the layer above
    re-selected and the gap is over the lowered margin; ``state.gap`` gets the largest gap."""
    gap = gap.flatten(1).amax(-1)  # (B,): the worst KV head (or query head) decides
    layer_idx = state.layer.layer_idx
    every = getattr(trigger, "every", 1)
    if every > 1:
        # the steps between the measured ones keep the selection: no gap (the layer's step counted),
        # unless ``challengers`` measured them against the units the last measured step found strongest
        measured = (state.steps + layer_idx) % every == 0
        state.steps.add_(1)
        if not getattr(trigger, "challengers", 0):
            gap = gap.masked_fill(~measured, float("-inf"))
    margin = trigger.margin_of(layer_idx)
    fire = (gap > margin) | ~state.has_selection
    if trigger.follow > 0 and state.above is not None:
        # the layer above decided this step already (its ``reselect``, on the device)
        fire = fire | (state.above.reselect & (gap > margin - trigger.follow))
    state.gap.copy_(gap.clamp(min=-1e4, max=1e4))
    return fire


def _count_age_and_note(trigger, state, fire: torch.Tensor, decision) -> torch.Tensor:
    """``fire`` with ``trigger.cap`` (the selection's age counted), noted in ``decision`` if given."""
    cap = getattr(trigger, "cap", 0)
    if cap > 0:
        # steps since the last selection, this one included: a selection is kept at most ``cap`` steps
        state.age.add_(1)
        fire = fire | (state.age >= cap)
    if decision is not None:
        note_decision(fire, *decision)
    return fire


def score_gap_selected(state, unit_ids: torch.Tensor, reselect: torch.Tensor) -> None:
    """A ``ScoreGapState`` after a re-selection: the rows where ``reselect (B,)`` hold exactly
    ``unit_ids (B, H, K)`` (the selection's units in score order, then -1; past the held list's
    length R only -1s), each listed unit ending at the buffer row where its sizes sum to (capped at
    R); the table and buffer as they are now are the next step's last look. In place."""
    ids = unit_ids
    room = state.held.shape[-1]
    if ids.shape[-1] >= room:
        ids = ids[..., :room]
    else:
        ids = torch.nn.functional.pad(ids, (0, room - ids.shape[-1]), value=-1)
    rows = reselect.view(-1, 1)
    state.held.copy_(torch.where(rows.unsqueeze(-1), ids, state.held))
    state.held_count.copy_(torch.where(rows, (ids >= 0).sum(-1), state.held_count))
    units, store = state.layer.units, state.layer.store
    state.seen_open.copy_(torch.where(reselect, units.open_unit, state.seen_open))
    state.seen_size.copy_(torch.where(rows, open_unit_size(units), state.seen_size))
    state.seen_admitted.copy_(torch.where(rows, store.admitted, state.seen_admitted))
    # sizes as the selector filled them (the leaving token was filed before it ran)
    sizes = units.size.gather(2, ids.clamp(min=0)).masked_fill(ids < 0, 0)
    ends = torch.cumsum(sizes, dim=-1).clamp(max=store.retrieval_capacity)
    state.held_end.copy_(torch.where(rows.unsqueeze(-1), ends.masked_fill(ids < 0, 0), state.held_end))
    state.units_at_selection.copy_(torch.where(reselect, units.decode_units, state.units_at_selection))
    state.age.masked_fill_(reselect, 0)
    state.has_selection.logical_or_(reselect)
    state.held_marks = None  # the Triton ops' marks of the list: made from it again where next read

