"""Pure-PyTorch reference for every kernel op. Fast backends are tested against these.

All ops are batched over (sequence, KV head), keep fixed output shapes and never read
tensor values on the host, so a decode step built from them can be graph-captured.
"""

from __future__ import annotations

from typing import Sequence

import torch


KMEANS_INITS = ("spaced", "pages")
KMEANS_PRECISIONS = ("split", "bf16")


def kmeans_page_labels(valid: torch.Tensor, num_clusters: int) -> torch.Tensor:
    """``(B, n)`` long: valid token of rank ``r`` (among its sequence's valid tokens) goes to page
    ``r * C // count``, so the pages are runs of consecutive valid tokens, ``count / C`` tokens
    each (at most ``ceil(count / C)``); invalid tokens get the label of the next valid one
    (ignored). Fewer valid tokens than clusters leaves some pages empty."""
    seen = torch.cumsum(valid.long(), dim=-1)  # (B, n)
    count = seen[:, -1:].clamp(min=1)
    rank = (seen - valid.long()).clamp(max=count - 1)  # rank of the token, or of the next valid one
    return torch.div(rank * num_clusters, count, rounding_mode="floor")


def kmeans(
    keys: torch.Tensor,
    valid: torch.Tensor,
    num_clusters: int,
    iters: int,
    init: str = "spaced",
    precision: str = "split",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lloyd's K-means per (sequence, KV head).

    ``keys``: ``(B, H, n, D)``; ``valid``: ``(B, n)`` bool, invalid tokens neither move
    centroids nor matter in their labels. Returns ``labels (B, H, n)`` long and ``centroids
    (B, H, C, D)`` float32: after ``iters`` (assignment, update) rounds, the labels of the last
    assignment and the centroids of the last update.

    ``init`` (deterministic either way): "spaced", centroids start at evenly spaced valid
    tokens of each sequence (labels all 0 at ``iters=0``); "pages", each starts as the mean key
    of a run of consecutive valid tokens (``kmeans_page_labels``; the labels at ``iters=0``),
    i.e. one update step from the page labels, a page left empty keeping its spaced token.
    ``precision``: "split", distances to the float32 centroid; "bf16", to the centroid rounded
    to bfloat16, from the key rounded to bfloat16 (one bf16 tensor-core dot on the GPU instead
    of two; labels may then differ from "split" near ties, updates still average the exact keys).
    """
    if init not in KMEANS_INITS:
        raise ValueError(f"kmeans: init must be one of {', '.join(KMEANS_INITS)}, got {init!r}")
    if precision not in KMEANS_PRECISIONS:
        raise ValueError(f"kmeans: precision must be one of {', '.join(KMEANS_PRECISIONS)}, got {precision!r}")
    batch, heads, n, dim = keys.shape
    x = keys.float()
    weight = valid[:, None, :].expand(batch, heads, n).float()
    # start from evenly spaced valid tokens of each sequence
    seen = torch.cumsum(valid.long(), dim=-1)  # (B, n)
    count = seen[:, -1:].clamp(min=1)
    spaced = torch.linspace(0, 1, num_clusters, device=keys.device)
    wanted = (spaced * (count - 1)).round().long() + 1  # 1-based rank among valid tokens
    init_tokens = torch.searchsorted(seen.contiguous(), wanted.contiguous()).clamp(max=n - 1)  # (B, C)
    centroids = x.gather(2, init_tokens[:, None, :, None].expand(batch, heads, num_clusters, dim)).clone()
    labels = torch.zeros(batch, heads, n, dtype=torch.long, device=keys.device)

    def update(labels, centroids):
        sums = torch.zeros_like(centroids).scatter_add_(2, labels.unsqueeze(-1).expand_as(x), x * weight.unsqueeze(-1))
        counts = torch.zeros(batch, heads, num_clusters, device=keys.device).scatter_add_(2, labels, weight)
        # an emptied cluster keeps its old centroid
        return torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp(min=1).unsqueeze(-1), centroids)

    if init == "pages":
        labels = kmeans_page_labels(valid, num_clusters)[:, None, :].expand(batch, heads, n).contiguous()
        centroids = update(labels, centroids)
    xd = x.to(torch.bfloat16).float() if precision == "bf16" else x
    for _ in range(iters):
        c = centroids.to(torch.bfloat16).float() if precision == "bf16" else centroids
        # ||x - c||^2 up to a per-token constant
        distance = c.pow(2).sum(-1).unsqueeze(2) - 2 * torch.einsum("bhnd,bhcd->bhnc", xd, c)
        labels = distance.argmin(dim=-1)
        centroids = update(labels, centroids)
    return labels, centroids


def select_budget(
    scores: torch.Tensor,
    sizes: torch.Tensor,
    starts: torch.Tensor,
    order: torch.Tensor,
    capacity: int,
    take: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fill a token budget with the best-scoring units, never exceeding it.

    ``scores``: ``(B, H, U)`` float, ``-inf`` for units that must not be chosen;
    ``sizes`` / ``starts``: ``(B, H, U)`` long, each unit is ``order[..., start:start+size]``;
    ``order``: ``(B, H, N)`` token slots; ``capacity``: the token budget ``R``.
    Units are taken whole in score order; the first that does not fit is cut to the room
    left, so the budget is filled exactly when there are enough tokens (a large unit at the
    top of the ranking never leaves the budget empty).
    Returns ``unit_ids (B, H, U)`` (chosen units in score order, then -1), ``num_units (B, H)``,
    ``slots (B, H, R)`` and ``slot_valid (B, H, R)``.
    ``take (B,)`` bool, optional: the sequences whose selection will be used. Outputs of the
    others are unspecified but safe to consume (``slots`` in ``[0, N)``, ``unit_ids`` in
    ``[-1, U)``); a fast backend skips their work, this reference computes every row.
    """
    ranked_scores, ranked = torch.sort(scores, dim=-1, descending=True, stable=True)
    selectable = ranked_scores > float("-inf")
    ranked_sizes = torch.where(selectable, sizes.gather(-1, ranked), 0)
    ends = torch.cumsum(ranked_sizes, dim=-1)
    begins = ends - ranked_sizes
    # begins is monotone, so the taken units form a prefix of the ranking
    taken = selectable & (ranked_sizes > 0) & (begins < capacity)
    num_units = taken.sum(-1)
    # chosen units first (zero-size units may sit between them in the ranking)
    compact = torch.sort((~taken).to(torch.uint8), dim=-1, stable=True).indices
    unit_ids = torch.where(taken, ranked, -1).gather(-1, compact)

    position = torch.arange(capacity, device=scores.device).expand(*scores.shape[:-1], capacity)
    slot_valid = position < ends[..., -1:]
    which = torch.searchsorted(ends.contiguous(), position.contiguous(), right=True)
    which = which.clamp(max=scores.shape[-1] - 1)
    unit = ranked.gather(-1, which)
    offset = position - begins.gather(-1, which)
    index = (starts.gather(-1, unit) + offset).clamp(0, order.shape[-1] - 1)
    slots = torch.where(slot_valid, order.gather(-1, index), 0)
    return unit_ids, num_units, slots, slot_valid


# the query dtypes ``unit_scores`` reads (a model's bfloat16 / float16 query as it is, widened exactly:
# a float32 copy was a launch of its own at every scoring, every step for the score_gap trigger)
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unit_scores(
    query_group: torch.Tensor,
    key_mean: torch.Tensor | None,
    key_min: torch.Tensor | None,
    key_max: torch.Tensor | None,
    selectable: torch.Tensor,
    method: str,
    take: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score every unit of a unit table for its KV head's query group; ``-inf`` where not selectable.

    ``query_group``: ``(B, H, G, D)`` float32, or the model's bfloat16 / float16 (widened to
    float32 first, exactly); ``key_mean``: ``(B, H, U, D)`` float16 (the
    table's ``key_mean``, see ``half_mean``); ``key_min`` / ``key_max``: ``(B, H, U, D)``
    float32; ``selectable``: ``(B, H, U)`` bool.
    ``method``: ``"mean"`` (``mean_key_scores``, reads ``key_mean``) or ``"bound"``
    (``key_bound_scores``, reads ``key_min`` and ``key_max``); the tensors a method does not
    read may be None. ``take (B,)`` bool, optional: the sequences whose scores will be used;
    the others' scores are unspecified (a fast backend skips them), this reference computes
    every row. Returns ``(B, H, U)`` float32.
    """
    if query_group.dtype not in QUERY_DTYPES:
        raise ValueError(f"unit_scores: the query group must be float32, bfloat16 or float16 (read as float32), "
                         f"got {query_group.dtype}")
    query_group = query_group.float()
    if method == "mean":
        scores = mean_key_scores(query_group, key_mean)
    elif method == "bound":
        scores = key_bound_scores(query_group, key_min, key_max, selectable)
    else:
        raise ValueError(f"unit_scores: unknown method {method!r}; accepted: 'mean', 'bound'")
    return scores.masked_fill(~selectable, float("-inf"))


def mean_key_scores(query_group: torch.Tensor, key_mean: torch.Tensor) -> torch.Tensor:
    """``mean_g q_g . key_mean`` per unit (``TopBudget``'s score), in float32 from the float16
    means; ``(B, H, U)``."""
    summed = torch.einsum("bhgd,bhud->bhu", query_group, key_mean.float())
    return summed / query_group.shape[2]


# float16's largest finite value: a mean beyond it is stored there, not as inf
HALF_MAX = 65504.0


def unit_stats(keys: torch.Tensor, labels: torch.Tensor, order: torch.Tensor, start: torch.Tensor,
               size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The key statistics of a prompt's units: float32 ``(sum, min, max)``, each ``(B, H, U, D)``.

    ``keys (B, H, n, D)``; ``labels (B, H, n)`` each token's unit in ``[0, U)``; ``order (B, H, n)``
    the token indices sorted by unit, ascending within a unit, and ``start``/``size (B, H, U)`` each
    unit's run of ``order`` (the same grouping as ``labels``: a fast backend reads whichever it
    needs). An empty unit has sum 0, min +inf, max -inf. Each sum adds its tokens in ascending
    order from 0, one float32 rounding per addition."""
    batch, heads, n, dim = keys.shape
    units = start.shape[-1]
    k = keys.float()
    index = labels.unsqueeze(-1).expand(batch, heads, n, dim)
    key_sum = torch.zeros(batch, heads, units, dim, device=keys.device).scatter_add_(2, index, k)
    key_min = torch.full((batch, heads, units, dim), float("inf"), device=keys.device)
    key_min.scatter_reduce_(2, index, k, reduce="amin", include_self=True)
    key_max = torch.full((batch, heads, units, dim), float("-inf"), device=keys.device)
    key_max.scatter_reduce_(2, index, k, reduce="amax", include_self=True)
    return key_sum, key_min, key_max


def half_mean(key_sum: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    """The float16 means a unit table keeps for scoring: ``key_sum / max(size, 1)`` in float32,
    clamped to float16's range, rounded to nearest even. Scoring reads them rather than the float32
    sums: half the bytes of the table read per scoring (the whole cost of scoring at decode sizes);
    the sums stay float32, so appends accumulate exactly as before."""
    return (key_sum / size.clamp(min=1).unsqueeze(-1)).clamp(-HALF_MAX, HALF_MAX).half()


def key_bound_scores(
    query_group: torch.Tensor, key_min: torch.Tensor, key_max: torch.Tensor, selectable: torch.Tensor
) -> torch.Tensor:
    """``max_g sum_d max(q_gd * key_min_d, q_gd * key_max_d)`` per unit (``Bound``'s score, Quest's
    upper bound), finite; ``(B, H, U)``."""
    # max(q*lo, q*hi) = relu(q)*hi + min(q, 0)*lo since lo <= hi: two matmuls instead of a
    # (B, H, G, U, D) product (which cost Quest 3.6 ms per step at 128K, batch 8)
    filled = selectable.unsqueeze(-1)
    # empty units have +-inf bounds; they are masked by the caller, keep them finite here
    low = torch.where(filled, key_min, 0.0)
    high = torch.where(filled, key_max, 0.0)
    positive = query_group.clamp(min=0)
    negative = query_group - positive
    bound = torch.einsum("bhgd,bhud->bhgu", positive, high) + torch.einsum("bhgd,bhud->bhgu", negative, low)
    return bound.amax(dim=2)


def gather_rows(pool: torch.Tensor, slots: torch.Tensor, out_device: torch.device) -> torch.Tensor:
    """Rows of ``pool (B, H, cap, D)`` at ``slots (B, H, R)`` -> ``(B, H, R, D)`` on ``out_device``."""
    index = slots.to(pool.device).unsqueeze(-1).expand(*slots.shape, pool.shape[-1])
    return pool.gather(2, index).to(out_device, non_blocking=True)


def write_row(pool: torch.Tensor, slot: torch.Tensor, row: torch.Tensor) -> None:
    """``pool[:, :, slot] = row``: one decode token's ``(B, H, D)`` into the pool at the 0-dim
    device counter ``slot`` (the pool may be in CPU memory; this reference then syncs)."""
    pool.index_copy_(2, slot.view(1).to(pool.device), row.unsqueeze(2).to(pool.device, pool.dtype))


def gather_rows_into(pool: torch.Tensor, slots: torch.Tensor, take: torch.Tensor, out: torch.Tensor) -> None:
    """``out[b] = pool[b, :, slots[b]]`` for the sequences where ``take (B,)`` is True.

    ``out``: ``(B, H, R, D)`` on the attention device, left untouched where ``take`` is False
    (a fast backend moves no bytes for those sequences).
    """
    rows = gather_rows(pool, slots, out.device)
    out.copy_(torch.where(take.view(-1, 1, 1, 1), rows, out))


def pool_rows(slots: torch.Tensor, zone_rows: torch.Tensor | None) -> torch.Tensor:
    """The pool row holding each of ``slots`` (``(B, H, R)``): ``zone_rows[b, h, slot]`` for a slot
    of the prompt's retrieval zone (``zone_rows (B, H, zone)``, laid out unit by unit; None: none),
    the slot itself after it."""
    if zone_rows is None or zone_rows.shape[-1] == 0:
        return slots
    zone = zone_rows.shape[-1]
    in_zone = zone_rows.gather(2, slots.clamp(0, zone - 1))
    return torch.where(slots < zone, in_zone, slots)  # int32 rows promote to long in the same kernel


def resident_rows(slots: torch.Tensor, take: torch.Tensor, buffer, source: torch.Tensor, rows_read: torch.Tensor,
                  slot_map: torch.Tensor, skip: torch.Tensor | None = None) -> None:
    """Where each wanted slot already sits in the current buffer, for ``refresh_rows``.

    ``slots``: ``(B, H, R)`` the new selection; ``buffer``: the current ``RetrievedBuffer`` (or
    ``RowCache``), whose ``slots`` / ``held`` ``(B, H, R')`` say the slot each row is labelled
    with, and whether the row really holds that slot's pool row. For the sequences where
    ``take (B,)``: ``source (B, H, R)`` int32 gets the last held row labelled with each wanted
    slot, or -1 (a negative slot is never found), and ``rows_read (B,)`` long grows by the count
    of -1 (rows the pool must supply). Both are left untouched for the other sequences.

    ``slot_map``: ``(B, H, M)`` int32 scratch, all -1, with ``M`` above every slot (the pool's
    capacity); a fast backend marks the held rows' slots in it and leaves it all -1 again. This
    reference does not touch it: sort + binary search, O(R log R). No host reads.

    ``skip`` ``(B, H, R)``: where ``skip >= 0`` (found already, in another buffer) the slot is
    not looked up: -1, as a negative slot.
    """
    if skip is not None:
        if skip.dtype.is_floating_point or skip.dtype == torch.bool:
            raise ValueError(f"resident_rows: skip must hold integer rows (-1: look up), got {skip.dtype}")
        slots = torch.where(skip >= 0, -1, slots)
    current_slots, current_held = buffer.slots, buffer.held
    if current_slots.shape[-1] == 0 or slots.shape[-1] == 0:
        found = torch.full(slots.shape, -1, dtype=torch.int32, device=slots.device)
    else:
        # rows that hold nothing sort first under -1; int32 keys halve the radix passes (slot
        # numbers stay far below 2**31). Stable, so the last of equal keys is the highest row.
        keys = torch.where(current_held, current_slots, -1).to(torch.int32)
        ordered, rows = torch.sort(keys, dim=-1, stable=True)
        wanted = slots.to(torch.int32).contiguous()
        at = (torch.searchsorted(ordered, wanted, right=True) - 1).clamp(min=0)
        hit = (ordered.gather(-1, at) == wanted) & (wanted >= 0)
        found = torch.where(hit, rows.gather(-1, at), -1).to(torch.int32)
    source.copy_(torch.where(take.view(-1, 1, 1), found, source))
    missing = (found < 0).flatten(1).sum(-1)
    rows_read.add_(torch.where(take, missing, 0))


def refresh_rows(
    pools: Sequence[torch.Tensor],
    slots: torch.Tensor,
    take: torch.Tensor,
    source: torch.Tensor,
    outs: Sequence[torch.Tensor],
    scratches: Sequence[torch.Tensor],
    caches: Sequence[torch.Tensor] | None = None,
    cache_source: torch.Tensor | None = None,
    zone_rows: torch.Tensor | None = None,
) -> None:
    """``gather_rows_into`` that reuses rows already on the device, for each part (a fetch's
    keys and values: ``pools``, ``outs``, ``scratches`` and ``caches`` hold one tensor a part).

    For the sequences where ``take (B,)``: ``out[b, h, r] = out[b, h, source[b, h, r]]`` where
    ``source >= 0`` (the current buffer holds that slot, see ``resident_rows``), else
    ``pool[b, h, slots[b, h, r]]``; the result equals ``gather_rows_into`` whenever each resident
    row holds its slot's pool row. Rows move between positions, so the new rows are assembled
    in ``scratch`` (same shape as ``out``, left with unspecified contents) and copied back; a
    fast backend reads only the non-resident rows from the pool.

    ``caches`` ``(B, H, C, D)`` (a ``RowCache``'s keys and values, on ``out``'s device) with
    ``cache_source (B, H, R)`` int32: where ``source < 0`` and ``cache_source >= 0`` the row is
    ``cache[b, h, cache_source]`` instead of the pool's (the GPU unit cache holds that slot).

    ``zone_rows``: where the pool lays out the prompt's zone (``pool_rows``); None: ``slots`` are
    the pool's rows.
    """
    slots = pool_rows(slots, zone_rows)
    if len(outs) != len(pools) or len(scratches) != len(pools) or (caches is not None and len(caches) != len(pools)):
        raise ValueError(f"refresh_rows: pools, outs, scratches and caches need one tensor a part, got {len(pools)}, "
                         f"{len(outs)}, {len(scratches)} and {'no' if caches is None else len(caches)}")
    # the parts share their layout: where each row comes from is worked out once
    out, cache = outs[0], None if caches is None else caches[0]
    resident = (source >= 0).unsqueeze(-1)
    # clamped: entries of sequences that do not take may be stale
    index = source.long().clamp(0, max(out.shape[2] - 1, 0)).unsqueeze(-1).expand(*source.shape, out.shape[-1])
    has_cache = cache is not None and cache.shape[2] > 0
    if has_cache:
        at = cache_source.long().clamp(0, cache.shape[2] - 1).unsqueeze(-1).expand(*source.shape, out.shape[-1])
        cached = (cache_source >= 0).unsqueeze(-1)
    for part, (pool, out, scratch) in enumerate(zip(pools, outs, scratches)):
        fetched = gather_rows(pool, slots, out.device)
        if has_cache:
            fetched = torch.where(cached, caches[part].gather(2, at), fetched)
        scratch.copy_(torch.where(resident, out.gather(2, index), fetched))
        out.copy_(torch.where(take.view(-1, 1, 1, 1), scratch, out))


def cache_insert(cache, dest: torch.Tensor, take: torch.Tensor, buffer) -> None:
    """File buffer rows in the GPU unit cache: for the sequences where ``take (B,)``, every row
    ``r`` of ``buffer`` (a ``RetrievedBuffer``) with ``dest[b, h, r] >= 0`` goes to row ``dest`` of
    ``cache`` (a ``RowCache``): its key, value, slot and held flag. ``dest (B, H, R)`` long; the
    rows it names are distinct per (sequence, head) (the store numbers its misses first in, first
    out). No host reads: each cache row learns which buffer row, if any, writes it (a max-scatter),
    so an emulated graph replay runs it too.
    """
    batch, heads, rows = dest.shape
    if rows == 0 or cache.rows == 0:
        return
    writes = (dest >= 0) & take.view(-1, 1, 1)
    row = torch.arange(rows, device=dest.device).expand(batch, heads, rows)
    writer = torch.full(cache.slots.shape, -1, dtype=torch.long, device=dest.device)
    writer.scatter_reduce_(2, dest.clamp(min=0), torch.where(writes, row, -1), reduce="amax")
    written = writer >= 0
    at = writer.clamp(min=0)
    for name in ("keys", "values"):
        into, rows_of = getattr(cache, name), getattr(buffer, name)
        moved = rows_of.gather(2, at.unsqueeze(-1).expand(*at.shape, rows_of.shape[-1]))
        into.copy_(torch.where(written.unsqueeze(-1), moved, into))
    cache.slots.copy_(torch.where(written, buffer.slots.gather(2, at), cache.slots))
    cache.held.copy_(torch.where(written, buffer.held.gather(2, at), cache.held))


def sparse_decode_attention(
    query: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    scale: float,
) -> torch.Tensor:
    """Single-query attention over several KV parts (sink, retrieved, local), GQA-aware.

    ``query``: ``(B, Hq, D)``; each part is ``(keys (B, H, n, D), values (B, H, n, D),
    valid (B, H, n) or (B, n) bool)``, and optionally a fourth item, a ``PoolRows`` whose rows the
    part reads from the pool instead (None: none); ``Hq`` a multiple of ``H``. Returns
    ``(B, Hq, D)`` in the query's dtype; softmax in float32.
    """
    batch, q_heads, dim = query.shape
    kv_heads = parts[0][0].shape[1]
    q = query.float().view(batch, kv_heads, q_heads // kv_heads, dim)
    logits, values = [], []
    for part in parts:
        keys, vals, valid = part[:3]
        from_pool = part[3] if len(part) > 3 else None
        if from_pool is not None:
            keys, vals = with_pool_rows(keys, vals, from_pool)
        if valid.dim() == 2:
            valid = valid[:, None, :].expand(batch, kv_heads, valid.shape[-1])
        score = torch.einsum("bhgd,bhnd->bhgn", q, keys.float()) * scale
        logits.append(score.masked_fill(~valid.unsqueeze(2), float("-inf")))
        values.append(vals.float())
    weights = torch.softmax(torch.cat(logits, dim=-1), dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", weights, torch.cat(values, dim=2))
    return out.reshape(batch, q_heads, dim).to(query.dtype)


def with_pool_rows(keys: torch.Tensor, values: torch.Tensor, from_pool) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of a part's ``keys``/``values`` whose rows ``from_pool`` (a ``PoolRows``) names hold
    the pool rows of its slots (a slot outside the pool is clamped into it: such a row is never valid)."""
    zone_rows = from_pool.zone_rows if from_pool.zone_end > 0 else None
    capacity = from_pool.keys.shape[2]
    rows = pool_rows(from_pool.slots, zone_rows).long().clamp(0, capacity - 1)
    index = rows.unsqueeze(-1).expand(*rows.shape, keys.shape[-1])
    place = slice(from_pool.start, from_pool.start + rows.shape[-1])
    keys, values = keys.clone(), values.clone()
    keys[:, :, place] = from_pool.keys.gather(2, index).to(keys.dtype)
    values[:, :, place] = from_pool.values.gather(2, index).to(values.dtype)
    return keys, values


def append_to_unit(
    order: torch.Tensor,
    start: torch.Tensor,
    size: torch.Tensor,
    key_sum: torch.Tensor,
    key_min: torch.Tensor,
    key_max: torch.Tensor,
    key_mean: torch.Tensor,
    selectable: torch.Tensor,
    open_unit: torch.Tensor,
    decode_units: torch.Tensor,
    position: torch.Tensor,
    slot: torch.Tensor,
    key: torch.Tensor,
    valid: torch.Tensor,
    cut: torch.Tensor,
    num_prompt_units: int,
) -> None:
    """File one token leaving the local window in a ``UnitTable`` (its tensors, in place).

    ``order (B, H, N)`` long gets ``slot`` (0-dim device long) at ``position`` (0-dim device
    long, the table's ``order_next``; not advanced here). ``cut (B,)`` bool: the token opens a
    new decode unit, id ``num_prompt_units + decode_units[b]`` (``open_unit`` and
    ``decode_units``, both ``(B,)`` long, are updated). Then the open unit of each sequence
    (unit 0 when none is open, left unchanged unless the token is valid) gets the token:
    ``start`` (set to ``position`` on a cut), ``size`` += ``valid``, the float32 ``key_sum``,
    ``key_min``, ``key_max`` ``(B, H, U, D)`` take ``key (B, H, D)`` where ``valid (B,)``, the
    float16 ``key_mean`` becomes ``half_mean`` of the new sum and size, and ``selectable (B, H, U)``
    bool becomes True where valid and a unit is open.
    """
    batch, heads, dim = key.shape
    order.index_copy_(2, position.view(1), slot.view(1, 1, 1).expand(batch, heads, 1))
    new_id = num_prompt_units + decode_units
    open_unit.copy_(torch.where(cut, new_id, open_unit))
    decode_units.add_(cut.long())

    index = open_unit.clamp(min=0).view(batch, 1, 1).expand(batch, heads, 1)
    vec_index = index.unsqueeze(-1).expand(batch, heads, 1, dim)
    cut_h = cut.view(batch, 1, 1)
    valid_h = valid.view(batch, 1, 1)
    k = key.float().unsqueeze(2)  # (B, H, 1, D)

    unit_start = torch.where(cut_h, position, start.gather(2, index))
    unit_size = torch.where(cut_h, 0, size.gather(2, index)) + valid_h.long()
    old_sum = torch.where(cut_h.unsqueeze(-1), 0.0, key_sum.gather(2, vec_index))
    old_min = torch.where(cut_h.unsqueeze(-1), float("inf"), key_min.gather(2, vec_index))
    old_max = torch.where(cut_h.unsqueeze(-1), float("-inf"), key_max.gather(2, vec_index))
    keep = valid_h.unsqueeze(-1)
    start.scatter_(2, index, unit_start)
    size.scatter_(2, index, unit_size)
    new_sum = torch.where(keep, old_sum + k, old_sum)
    key_sum.scatter_(2, vec_index, new_sum)
    key_mean.scatter_(2, vec_index, half_mean(new_sum, unit_size))
    key_min.scatter_(2, vec_index, torch.where(keep, torch.minimum(old_min, k), old_min))
    key_max.scatter_(2, vec_index, torch.where(keep, torch.maximum(old_max, k), old_max))
    selectable.scatter_(2, index, selectable.gather(2, index) | (valid_h & (open_unit >= 0).view(batch, 1, 1)))


def admit_row(buffer, evicted, reselected: torch.Tensor, kept: torch.Tensor | None = None,
              admitted: torch.Tensor | None = None) -> None:
    """Append the token the ring pushed out to the retrieved buffer of each (sequence, head) that
    has room, in place; with ``kept``, a full buffer admits it too, over its lowest-ranked row.

    ``buffer``: a ``RetrievedBuffer`` (keys/values ``(B, H, R, D)``, slots ``(B, H, R)`` long,
    valid/held ``(B, H, R)`` bool, fill ``(B, H)`` long); ``evicted``: an ``Evicted`` (key/value
    ``(B, H, D)``, slot 0-dim device long, valid ``(B,)``). ``reselected (B,)``: the sequences that
    re-selected at this step (after their fetch); they admit nothing. Where ``fill < R``, not
    ``reselected`` and ``evicted.valid``: row ``fill`` takes the token's key, value and slot, is marked valid and
    held, and ``fill`` grows by one.

    ``kept (B, H)`` long, optional: rows ``[0, kept)`` still hold the last selection's rows. A
    selection lays its rows out in score order (``select_budget``), so row ``kept - 1`` is the
    lowest-ranked one left: where the buffer is full, ``kept > 0``, not ``reselected`` and
    ``evicted.valid``, the token replaces that row and ``kept`` drops by one. Where ``reselected``
    ``kept`` is reset to ``fill``. Once every selected row
    is replaced (``kept == 0``) a full buffer admits nothing, so the eviction is bounded by the
    selection's own rows and the re-selection trigger sees which units left.
    ``admitted (B, H)`` long, optional: grows by one wherever the token was admitted (either way).
    Nothing changes elsewhere.
    """
    batch, heads, capacity, dim = buffer.keys.shape
    if capacity == 0:
        return
    allowed = (~reselected & evicted.valid).view(batch, 1)
    room = buffer.fill < capacity  # (B, H)
    append = room & allowed
    replace = torch.zeros_like(append) if kept is None else ~room & (kept > 0) & allowed
    admit = append | replace
    row = torch.where(room, buffer.fill, capacity if kept is None else kept - 1)
    index = row.clamp(0, capacity - 1).unsqueeze(-1)  # (B, H, 1)
    vec = index.unsqueeze(-1).expand(batch, heads, 1, dim)
    a = admit.view(batch, heads, 1, 1)
    old_k = buffer.keys.gather(2, vec)
    old_v = buffer.values.gather(2, vec)
    buffer.keys.scatter_(2, vec, torch.where(a, evicted.key.unsqueeze(2), old_k))
    buffer.values.scatter_(2, vec, torch.where(a, evicted.value.unsqueeze(2), old_v))
    old_slot = buffer.slots.gather(2, index)
    buffer.slots.scatter_(2, index, torch.where(admit.unsqueeze(-1), evicted.slot, old_slot))
    old_valid = buffer.valid.gather(2, index)
    buffer.valid.scatter_(2, index, old_valid | admit.unsqueeze(-1))
    # the ring's copy of a token has the same bits as its pool row
    old_held = buffer.held.gather(2, index)
    buffer.held.scatter_(2, index, old_held | admit.unsqueeze(-1))
    buffer.fill.add_(append.long())
    if kept is not None:
        reset = reselected.view(batch, 1)
        kept.copy_(torch.where(reset, buffer.fill, kept - replace.long()))
    if admitted is not None:
        admitted.add_(admit.long())


def number_misses(store, reselect: torch.Tensor) -> None:
    """After both ``resident_rows`` of a fetch with a unit cache: the wanted rows that neither the
    buffer (``store.source``) nor the cache (``store.cache_source``) holds, for the sequences where
    ``reselect (B,)``, are counted in ``store.pool_rows_read`` and each given the cache row it will
    replace (``store.cache_dest``: first in first out from the cache's cursor, in row order; -1
    elsewhere); the cursor moves past them."""
    cache = store.cache
    miss = (store.source < 0) & (store.cache_source < 0) & reselect.view(-1, 1, 1)
    count = miss.sum(-1)
    store.pool_rows_read.add_(count.sum(-1))
    rank = miss.cumsum(-1) - miss.long()
    store.cache_dest.copy_(torch.where(miss, (cache.cursor.unsqueeze(-1) + rank) % cache.rows, -1))
    cache.cursor.copy_((cache.cursor + count) % cache.rows)
