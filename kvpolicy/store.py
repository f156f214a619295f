"""The tiers of one layer's KV.

    pool       every token: pinned CPU memory (placement "cpu" with a GPU) or the attention
               device (placement "gpu"). Written once per token, read by gathers. Generated
               tokens and the prompt's local window sit at row = slot; the prompt's retrieval
               zone is laid out unit by unit (``lay_out_zone``), so a fetched unit is one
               contiguous run of rows, not scattered single rows.
    attended   one buffer on the attention device, sink | retrieved | local: the three tiers
               below are views of it, so a step's attention is one launch over one part.
               Each tier holds at most the rows the tokens so far can fill (``rows_for``), grown
               by the step's plan (``make_room``) or before a capture (``reserve``): with a unit
               table the buffer never holds more rows than the sequence has tokens, so a short
               prompt with a large budget costs what its tokens cost, never more than the full
               KV (ParisKV's index may ask for a few rows more: ``retrievable``).
    sink       the first ``sink`` tokens of each sequence, on the attention device.
    local      a fixed ring of the last ``local`` slots, on the attention device.
    retrieved  a fixed buffer of ``retrieval`` tokens fetched from the pool, reused until the
               trigger fires again; tokens leaving the local window join it while it has room.
               A re-selection reads from the pool only the rows the buffer does not hold yet.
               With the pool in GPU memory a re-selection reads every selected row; where the
               policy re-selects at every step the buffer holds only the slots, and attention
               reads their rows from the pool (``attends_pool_by_slot``).

    cache      optional, on the attention device, not attended: the rows re-selections read
               from a host pool most recently (``RowCache``, first in first out), so a unit
               that leaves the selection and comes back is not read across PCIe again.

Each tier is typed (``kvpolicy/tiers.py``: ``Pool``, ``Tier``, ``SinkTier``, ``RetrievedBuffer``,
``RowCache``), and the step's ops take the tier they work on.

Sequences of a batch decode in lockstep, so slot numbers (and the ring position of a slot)
are the same for every sequence. The host counts them (``length``) to size buffers, but a
decode step reads the slot from a device counter (``next_slot``), never from the host: with
room reserved up front, a captured step replays correctly (CUDA graphs). What differs per
sequence (padding, what was selected) lives in tensors on the device.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch

from .kernels import dispatch, reference
from .pinned import pinned_empty
from .tiers import Evicted, Pool, PoolRows, RetrievedBuffer, RowCache, SinkTier, Tier

# where the pool sits in the attention device's memory, attention may read the retrieved rows from
# it by slot (``PoolRows``), so that a re-selection writes the slots alone, or from the buffer, into
# which a re-selection copies them (``fetch_whole``). By slot, every step's attention waits on the
# slots' loads; copied, every re-selection moves the rows. So "every_step" (the default): by slot
# where the policy re-selects at every step (it moves no row and reads each once either way), copied
# where it keeps its selection (session 42, H100, 2,304 tokens, batch 8: a reusing step 9.56 ms
# copied against 10.14 by slot, at 20% re-selecting 10.08 against 10.29, re-selecting at every step
# 11.45 against 10.31; docs/bench/session42/s1). True or False: every such store by slot, or none
# (a setting so that a benchmark can time them, benchmarks/with_settings.py); read when a store is made
ATTEND_POOL_BY_SLOT: bool | str = "every_step"
ATTEND_POOL_CHOICES = ("every_step", True, False)


def attends_pool_by_slot(reselects_every_step: bool) -> bool:
    """Whether a store whose pool sits in its attention device's memory attends it by slot
    (``ATTEND_POOL_BY_SLOT``), for a policy that re-selects at every step or not."""
    if isinstance(ATTEND_POOL_BY_SLOT, bool):
        return ATTEND_POOL_BY_SLOT
    if ATTEND_POOL_BY_SLOT == "every_step":
        return reselects_every_step
    raise ValueError(f"store.ATTEND_POOL_BY_SLOT must be one of {ATTEND_POOL_CHOICES}; got {ATTEND_POOL_BY_SLOT!r}")


def _allocate_pool(like: torch.Tensor, capacity: int, device: torch.device, attention_device: torch.device) -> torch.Tensor:
    """An empty pool shaped like ``like`` with ``capacity`` slots; pinned when it is host memory
    read by a GPU (the attention device)."""
    batch, heads, _, dim = like.shape
    shape = (batch, heads, capacity, dim)
    if device.type == "cpu" and attention_device.type == "cuda":
        return pinned_empty(shape, like.dtype)
    return torch.empty(shape, dtype=like.dtype, device=device)


# Work buffers of fetch, one per (shape, dtype, device), shared by every layer's store: fetches
# run one after another on one stream (the slot map, all -1 between fetches, relies on it), and
# a scratch per layer would add half the retrieved buffers' memory. Held weakly: one goes when
# the last store using it does.
_SHARED: weakref.WeakValueDictionary[tuple, torch.Tensor] = weakref.WeakValueDictionary()


def _shared(shape: tuple, dtype: torch.dtype, like: torch.Tensor, fill: float | None = None,
            purpose: str = "") -> torch.Tensor:
    # an inference tensor may not be written outside inference mode: keep the two apart; two
    # buffers of one shape that a fetch uses at once differ by ``purpose``
    key = (tuple(shape), dtype, like.device, like.is_inference(), purpose)
    found = _SHARED.get(key)
    if found is None:
        found = torch.empty(shape, dtype=dtype, device=like.device)
        if fill is not None:
            found.fill_(fill)
        _SHARED[key] = found
    return found


def _pair_scratch(like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a fetch assembles its new key rows and value rows (one launch fills both)."""
    return tuple(_shared(like.shape, like.dtype, like, purpose=part) for part in ("keys", "values"))


def _copy_prompt(pool: torch.Tensor, rows: torch.Tensor, first: int = 0) -> None:
    """``pool[:, :, first:n] = rows[:, :, first:]`` (``rows (B, H, n, D)``), as plain
    device-to-host copies when the pool is pinned.

    ``pool[:, :, :n]`` is not contiguous (each head owns ``capacity`` rows), and torch copies to
    a non-contiguous host destination through a staging buffer; with a pinned pool TTFT at 16K
    was 4.4x full attention's against 1.1x with a GPU pool (BENCHMARKS.md), which this is
    suspected of. Each (sequence, head) slab is contiguous, so it goes as one asynchronous copy;
    the copies are stream-ordered, so later gathers see the rows, and the host never reads them.
    """
    n = rows.shape[2]
    if n <= first:
        return
    if pool.device == rows.device:
        pool[:, :, first:n].copy_(rows[:, :, first:])
        return
    for b in range(rows.shape[0]):
        for h in range(rows.shape[1]):
            pool[b, h, first:n].copy_(rows[b, h, first:], non_blocking=True)


def _rows_for(tokens: int, sink: int, retrieval: int, local: int, wanted: int) -> tuple[int, int, int]:
    """``(sink, retrieved, local)`` rows of the attended buffer that a sequence of ``tokens``
    tokens can fill, for ``sink`` sink rows, a retrieved tier of at most ``retrieval`` rows and a
    ``local`` window, when the retrieval index may ask for ``wanted`` rows.

    The ring holds the last ``min(local, tokens)``. Of the ``outside = tokens - local`` tokens
    before it, sink row ``j`` can be valid only once ``j < outside`` (it is the ``j``-th valid
    token, at slot ``j`` or later). The retrieved tier takes ``wanted`` rows (``TieredStore.
    retrievable``), at most ``retrieval``, so a budget past the context still attends every token.
    """
    outside = max(tokens - local, 0)
    return min(sink, outside), min(retrieval, max(wanted, 0)), min(local, tokens)


@dataclass
class TieredStore:
    """One layer's KV in its tiers (see the module docstring); the three attended tiers are
    views of ``attended``, re-made together when the plan grows it."""

    pool: Pool
    attended: Tier  # (B, H, S + R + L): sink | retrieved | local, so a step's attention reads one part
    sink: SinkTier  # its ``slots`` are the first rows of ``sink_slots_all``: those filled so far
    retrieved: RetrievedBuffer
    local: Tier  # a ring: slot s lives at s % L (L < local_limit: no slot >= L yet)
    length: int  # slots written, counted on the host (buffer sizes, statistics)
    next_slot: torch.Tensor  # () long on the attention device: the slot the next token takes
    zone_end: int  # slots [0, zone_end) of the prompt are sink or retrievable
    # (B,) long, cumulative: buffer rows fetch read from the pool, over all heads (a row is one
    # token's key and value of one head); a fetch of R fresh rows adds H * R
    pool_rows_read: torch.Tensor | None = None
    # (B,) long, cumulative: buffer rows the re-selections asked for, over all heads; with
    # ``pool_rows_read`` the miss fraction (rows neither the buffer nor the cache held)
    rows_fetched: torch.Tensor | None = None
    # the GPU unit cache (None: none; ``set_cache``)
    cache: RowCache | None = None
    # fetch's work buffers, shared by the stores of one shape (see _shared): two (B, H, R, D)
    # where the new key and value rows are assembled, and (B, H, R) int32, the buffer row holding
    # each wanted slot
    scratch: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    source: torch.Tensor | None = field(default=None, repr=False)
    # with a unit cache, shared like the two above: (B, H, R) int32, the cache row holding each
    # wanted slot; (B, H, R) long, the cache row each miss goes to; (B,) long, a count not kept
    cache_source: torch.Tensor | None = field(default=None, repr=False)
    cache_dest: torch.Tensor | None = field(default=None, repr=False)
    unread: torch.Tensor | None = field(default=None, repr=False)
    # (B, H, pool capacity) int32, all -1 between fetches: the slot -> row map through which
    # ``resident_rows`` finds the rows the buffer and the cache hold; shared like the ones above
    slot_map: torch.Tensor | None = field(default=None, repr=False)
    # what ``append`` writes each step, in fixed buffers (a replay refills them): the token the
    # ring pushed out, and () long, the slot the step's token took
    evicted: Evicted | None = field(default=None, repr=False)
    current_slot: torch.Tensor | None = field(default=None, repr=False)
    # the policy's retrieved rows (budget - sink - local); the buffer holds fewer while fewer
    # tokens have left the local window, and the plan grows it (``make_room``) up to this
    retrieval_limit: int | None = None
    # the policy's local window; the ring holds fewer rows while the sequence is shorter
    local_limit: int | None = None
    # (B, min(sink, prompt)): the slot of every sink row there will be
    sink_slots_all: torch.Tensor | None = None
    # whether the retrieval index is a unit table (``lay_out_zone`` got a unit order), whose
    # units hold retrievable tokens only; see ``retrievable`` for what other indexes may ask
    unit_table: bool = False
    prompt_length: int | None = None
    # (B, H) long, for ``admit``: rows [0, kept) still hold the last selection's rows (in score
    # order), and how many leaving tokens the buffer admitted so far (a trigger reads it)
    kept: torch.Tensor | None = None
    admitted: torch.Tensor | None = None
    # fetch reads every selected row from the pool, without looking up the rows the buffer holds:
    # set where the pool sits in the GPU's own memory, where that lookup (``resident_rows``: 16 us
    # a layer at 4 x 128K on an H200 through the slot map, measured on a host pool) costs more
    # than the HBM bytes it saves (~8 us)
    read_whole: bool = False
    # attention reads the retrieved rows from the pool by slot (``attends_pool_by_slot``): set
    # with ``read_whole`` for a policy that re-selects at every step (``ATTEND_POOL_BY_SLOT``),
    # cleared for good when the pool leaves the device (``stop_attending_pool``)
    attend_pool: bool = False

    def __post_init__(self) -> None:
        keys = self.retrieved.keys
        if self.pool_rows_read is None:
            self.pool_rows_read = torch.zeros(keys.shape[0], dtype=torch.long, device=keys.device)
        if self.rows_fetched is None:
            self.rows_fetched = torch.zeros(keys.shape[0], dtype=torch.long, device=keys.device)
        if self.scratch is None:
            if self.retrieved.values.shape != keys.shape or self.retrieved.values.dtype != keys.dtype:
                raise ValueError("TieredStore: retrieved keys and values must have one shape and dtype")
            self.scratch = _pair_scratch(keys)
        if self.source is None:
            # -1 (nothing resident) until written: a backend may read entries it was not asked to fill
            self.source = _shared(keys.shape[:3], torch.int32, keys, fill=-1)
        if self.slot_map is None:
            self._slot_map_scratch()
        if self.evicted is None:
            ring = self.local.keys
            batch, heads, _, dim = ring.shape
            self.evicted = Evicted(
                slot=torch.zeros((), dtype=torch.long, device=ring.device),
                key=ring.new_zeros(batch, heads, dim),
                value=self.local.values.new_zeros(batch, heads, dim),
                valid=torch.zeros(batch, dtype=torch.bool, device=ring.device),
            )
        if self.current_slot is None:
            self.current_slot = self.next_slot.clone()
        if self.retrieval_limit is None:
            self.retrieval_limit = self.retrieval_capacity
        if self.local_limit is None:
            self.local_limit = self.local_capacity
        if self.sink_slots_all is None:
            self.sink_slots_all = self.sink.slots
        if self.prompt_length is None:
            self.prompt_length = self.length
        for name in ("kept", "admitted"):
            if getattr(self, name) is None:
                setattr(self, name, torch.zeros(keys.shape[:2], dtype=torch.long, device=keys.device))

    @property
    def local_capacity(self) -> int:
        return self.local.rows

    @property
    def retrieval_capacity(self) -> int:
        return self.retrieved.rows

    @classmethod
    def from_prefill(
        cls,
        keys: torch.Tensor,
        values: torch.Tensor,
        token_valid: torch.Tensor,
        sink: int,
        local: int,
        retrieval: int,
        pool_device: torch.device,
        reserve: int = 256,
        defer_zone: bool = False,
        reselects_every_step: bool = False,
    ) -> "TieredStore":
        """Lay out a prompt's KV (``(B, H, P, D)``; ``token_valid (B, P)``, False = padding).

        ``defer_zone``: leave the pool rows of the retrieval zone unwritten; the caller writes
        them unit by unit with ``lay_out_zone`` once the units exist. ``reselects_every_step``:
        the policy re-selects at every step (``attends_pool_by_slot``).
        """
        batch, heads, prompt, dim = keys.shape
        device = keys.device
        zone_end = max(prompt - local, 0)

        pool_keys = _allocate_pool(keys, prompt + reserve, pool_device, device)
        pool_values = _allocate_pool(values, prompt + reserve, pool_device, device)
        first = zone_end if defer_zone else 0
        _copy_prompt(pool_keys, keys, first)
        _copy_prompt(pool_values, values, first)
        slot_valid = torch.zeros(batch, prompt + reserve, dtype=torch.bool, device=device)
        slot_valid[:, :prompt] = token_valid

        # the j-th sink token is the j-th valid slot of the prompt. One still in the local window
        # is attended there: its sink row becomes valid when the ring pushes it out
        # (``append_token``), so a prompt shorter than the window keeps its sink too. A prompt of
        # fewer tokens than ``sink`` has fewer sink rows: the others could never be filled
        sink = min(sink, prompt)
        seen = torch.cumsum(token_valid.long(), dim=-1)
        wanted = torch.arange(1, sink + 1, device=device).expand(batch, sink).contiguous()
        sink_slots = torch.searchsorted(seen.contiguous(), wanted)
        sink_found = sink_slots < prompt
        # a sequence of fewer valid tokens than the sink: the missing rows stay invalid, at a slot
        # no token will leave the ring from
        sink_slots = torch.where(sink_found, sink_slots, -1)

        # what a step attends lives in one buffer, sink | retrieved | local, so attention is one
        # launch over one part; the tiers are views of it (validity per head: the retrieved tier's
        # differs by head, the sink's and the ring's are the same for every head). Each tier has
        # the rows the prompt's tokens can fill (``rows_for``); the plan grows them as tokens come
        # (at the prompt's length every index asks for the zone's retrievable tokens)
        sink_rows, retrieval_rows, local_rows = _rows_for(prompt, sink, retrieval, local, zone_end - min(sink, zone_end))
        attended = sink_rows + retrieval_rows + local_rows
        attended_keys = keys.new_zeros(batch, heads, attended, dim)
        attended_values = values.new_zeros(batch, heads, attended, dim)
        attended_valid = torch.zeros(batch, heads, attended, dtype=torch.bool, device=device)
        sink_part = slice(0, sink_rows)
        retrieved_part = slice(sink_rows, sink_rows + retrieval_rows)
        local_part = slice(sink_rows + retrieval_rows, None)
        if sink_rows:
            index = sink_slots[:, :sink_rows].clamp(min=0)[:, None, :, None].expand(batch, heads, sink_rows, dim)
            attended_keys[:, :, sink_part] = keys.gather(2, index)
            attended_values[:, :, sink_part] = values.gather(2, index)
            attended_valid[:, :, sink_part] = (sink_slots[:, :sink_rows] < zone_end)[:, None, :]
        # the ring holds min(local, prompt) rows: prompt slot s at s % local, which is s when the
        # prompt is shorter than the window (so the ring can grow without moving a row)
        positions = torch.arange(zone_end, prompt, device=device) % local
        local_keys, local_values = attended_keys[:, :, local_part], attended_values[:, :, local_part]
        local_keys[:, :, positions] = keys[:, :, zone_end:]
        local_values[:, :, positions] = values[:, :, zone_end:]
        local_valid_heads = attended_valid[:, :, local_part]
        local_valid_heads[:, :, positions] = token_valid[:, None, zone_end:]

        return cls(
            pool=Pool(pool_keys, pool_values, slot_valid),
            attended=Tier(attended_keys, attended_values, attended_valid),
            sink=SinkTier(attended_keys[:, :, sink_part], attended_values[:, :, sink_part],
                          attended_valid[:, :, sink_part], sink_slots[:, :sink_rows]),
            retrieved=RetrievedBuffer(
                attended_keys[:, :, retrieved_part], attended_values[:, :, retrieved_part],
                attended_valid[:, :, retrieved_part],
                slots=torch.zeros(batch, heads, retrieval_rows, dtype=torch.long, device=device),
                held=torch.zeros(batch, heads, retrieval_rows, dtype=torch.bool, device=device),
                fill=torch.zeros(batch, heads, dtype=torch.long, device=device),
            ),
            local=Tier(local_keys, local_values, local_valid_heads),
            length=prompt,
            next_slot=torch.full((), prompt, dtype=torch.long, device=device),  # a fill: torch.tensor would sync
            zone_end=zone_end,
            retrieval_limit=retrieval,
            local_limit=local,
            sink_slots_all=sink_slots,
            read_whole=pool_keys.device == device and device.type == "cuda",
            attend_pool=attends_pool_by_slot(reselects_every_step) and pool_keys.device == device
            and device.type == "cuda",
        )

    def lay_out_zone(self, keys: torch.Tensor, values: torch.Tensor, order: torch.Tensor | None, ops=None) -> None:
        """Write the prompt's retrieval zone into the pool in ``order`` (``(B, H, zone_end)``, a
        permutation of the zone's slots per head, units contiguous): pool row ``i`` of head
        ``(b, h)`` holds slot ``order[b, h, i]``; ``None``: row = slot (an index of single
        tokens has no runs to keep together). ``keys``/``values``: the prompt's ``(B, H, P, D)``.
        A unit order also tells the store that its index is a unit table, whose units hold only
        retrievable tokens, so the retrieved tier grows by the tighter rule (``retrievable``).
        ``ops``: the kernel ops (or a backend name) whose ``gather_rows`` reorders the rows; the
        reference's by default."""
        zone = self.zone_end
        self.unit_table = order is not None
        if zone == 0:
            return
        pool = self.pool
        if order is None:
            _copy_prompt(pool.keys, keys[:, :, :zone])
            _copy_prompt(pool.values, values[:, :, :zone])
            return
        order = order[..., :zone]
        # a row gather reads one index a row; torch.gather with an expanded index reads one an element
        gather = dispatch.as_ops(ops, keys.device).gather_rows
        _copy_prompt(pool.keys, gather(keys[:, :, :zone], order, keys.device))
        _copy_prompt(pool.values, gather(values[:, :, :zone], order, keys.device))
        # int32: the table is held per layer for the whole generation (4 x 128K: 16 MB a layer)
        rows = torch.empty(order.shape, dtype=torch.int32, device=order.device)
        rows.scatter_(2, order, torch.arange(zone, dtype=torch.int32, device=order.device).expand_as(order))
        pool.zone_rows = rows

    def pool_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """The pool row holding each of ``slots`` (``(B, H, R)``)."""
        return reference.pool_rows(slots, self.pool.zone_rows)

    def sink_slot_mask(self) -> torch.Tensor:
        """``(B, zone_end)`` True where a zone slot is a sink token (so not retrievable)."""
        zone_valid = self.pool.valid[:, : self.zone_end]
        seen = torch.cumsum(zone_valid.long(), dim=-1)
        return zone_valid & (seen <= self.sink_slots_all.shape[1])

    def rows_for(self, tokens: int) -> tuple[int, int, int]:
        """``(sink, retrieved, local)`` rows a sequence of ``tokens`` tokens can fill (``_rows_for``)."""
        return _rows_for(tokens, self.sink_slots_all.shape[1], self.retrieval_limit, self.local_limit,
                         self.retrievable(tokens))

    def retrievable(self, tokens: int) -> int:
        """The most retrieved rows the index may ask for once the sequence has ``tokens`` tokens.

        A unit table's units hold retrievable tokens only: no sink token and no padding. A
        sequence has at most ``outside - sink`` of them before the window (its sink tokens are its
        first valid ones; one with fewer valid tokens than ``sink`` rows has that many more
        padding slots), so the tiers sum to at most ``tokens`` rows: never more than the full KV.
        Another index is held to what ParisKV's asks for: it files a position for every decode
        step, and its update buffer lays each one out in a row, valid or not (a short prompt's
        sink tokens, the steps where no token left the ring yet); only the zone's sink tokens
        stay out. On a prompt shorter than ``local + sink`` that is up to ``local - prompt +
        sink`` rows more than the sequence has tokens.
        """
        sink, zone = self.sink_slots_all.shape[1], self.zone_end
        outside = max(tokens - self.local_limit, 0)
        if self.unit_table:
            return outside - sink
        positions = max(outside, zone + tokens - self.prompt_length)
        return positions - min(sink, zone)

    def reserve(self, tokens: int) -> None:
        """Room for ``tokens`` more decode tokens without growing (before capturing a step)."""
        self._fit(self.length + tokens)
        pool = self.pool
        capacity = pool.capacity
        if self.length + tokens <= capacity:
            return
        new = self.length + tokens
        for name in ("keys", "values"):
            old = getattr(pool, name)
            grown = _allocate_pool(old, new, old.device, pool.valid.device)
            grown[:, :, :capacity].copy_(old)
            setattr(pool, name, grown)
        pad = torch.zeros(pool.valid.shape[0], new - capacity, dtype=torch.bool, device=pool.valid.device)
        pool.valid = torch.cat([pool.valid, pad], dim=1)
        self._slot_map_scratch()

    def _slot_map_scratch(self) -> None:
        batch, heads = self.retrieved.keys.shape[:2]
        self.slot_map = _shared((batch, heads, self.pool.capacity), torch.int32, self.retrieved.keys, fill=-1,
                                purpose="slot map")

    def make_room(self) -> None:
        """Room for one more token (host side, before the step's kernels): in the pool (doubling),
        and in the attended buffer's tiers, which grow to exactly what the next token makes
        attendable (``rows_for``), so they never hold more rows than the sequence has tokens."""
        if self.length >= self.pool.capacity:
            self.reserve(self.pool.capacity)
        self._fit(self.length + 1)

    def _fit(self, tokens: int) -> None:
        wanted = self.rows_for(tokens)
        now = (self.sink.rows, self.retrieval_capacity, self.local_capacity)
        # grow only: a reserve may have made a tier larger than this token needs, and a buffer
        # re-made inside a captured step would leave the graph reading the old one
        if any(w > n for w, n in zip(wanted, now)):
            self._grow_attended(*(max(w, n) for w, n in zip(wanted, now)))

    def _grow_attended(self, sink: int, rows: int, local: int) -> None:
        """A new attended buffer of ``sink + rows + local`` rows: the tiers' rows so far copied
        over, the new ones empty (a new sink row takes its token from the pool, invalid until the
        ring pushes the token out), the views re-made (host side, before a step or a capture,
        never inside one). The ring grows only while no slot has reached its size, so every slot
        it holds keeps its position ``slot % L``."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise AssertionError("the attended buffer cannot grow inside a captured step: reserve the steps first")
        old_sink, old, old_local = self.sink.rows, self.retrieval_capacity, self.local_capacity
        if local != old_local and self.length > old_local:
            raise AssertionError(f"the local ring of {old_local} rows cannot grow to {local}: slot {self.length - 1} "
                                 "already wrapped around it")
        was = self.attended
        batch, heads, _, dim = was.keys.shape
        total = sink + rows + local
        grown = Tier(was.keys.new_zeros(batch, heads, total, dim), was.values.new_zeros(batch, heads, total, dim),
                     was.valid.new_zeros(batch, heads, total))
        for new, before in ((grown.keys, was.keys), (grown.values, was.values), (grown.valid, was.valid)):
            new[:, :, :old_sink] = before[:, :, :old_sink]
            new[:, :, sink : sink + old] = before[:, :, old_sink : old_sink + old]
            new[:, :, sink + rows : sink + rows + old_local] = before[:, :, old_sink + old :]
        if sink > old_sink:
            slots = self.sink_slots_all[:, old_sink:sink]
            rows_of = self.pool_rows(slots.clamp(min=0)[:, None, :].expand(batch, heads, -1).contiguous())
            for new, pool in ((grown.keys, self.pool.keys), (grown.values, self.pool.values)):
                index = rows_of.to(pool.device)[..., None].expand(batch, heads, sink - old_sink, dim)
                new[:, :, old_sink:sink] = pool.gather(2, index).to(new.device, new.dtype)

        def part(at: slice) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return grown.keys[:, :, at], grown.values[:, :, at], grown.valid[:, :, at]

        self.attended = grown
        self.sink = SinkTier(*part(slice(0, sink)), slots=self.sink_slots_all[:, :sink])
        self.local = Tier(*part(slice(sink + rows, None)))
        buffer = self.retrieved
        slots, held = buffer.slots, buffer.held
        if rows != old:
            slots, held = slots.new_zeros(batch, heads, rows), held.new_zeros(batch, heads, rows)
            slots[:, :, :old], held[:, :, :old] = buffer.slots, buffer.held
        self.retrieved = RetrievedBuffer(*part(slice(sink, sink + rows)), slots=slots, held=held, fill=buffer.fill)
        if rows != old:
            self.scratch = _pair_scratch(self.retrieved.keys)
            self.source = _shared(self.retrieved.keys.shape[:3], torch.int32, grown.keys, fill=-1)
            if self.cache is not None:
                self._cache_scratch()

    def append(self, key: torch.Tensor, value: torch.Tensor, ops) -> Evicted:
        """Write one decode token (``(B, H, D)``) to the pool and the local ring.

        Returns the token the ring pushed out (``self.evicted``, refilled each step; not valid
        while the ring is still filling). ``ops``: the bound kernel ops (``dispatch.bind``).
        """
        self.make_room()  # a no-op after the layer's plan step (kept for direct callers)
        dispatch.as_ops(ops, key.device).append_token(self, key, value)
        self.next_slot.add_(1)
        self.length += 1
        return self.evicted

    def set_cache(self, rows: int) -> None:
        """Keep the last ``rows`` rows per (sequence, head) that re-selections read from the pool
        on the attention device (the GPU unit cache); at least the policy's retrieved rows, so
        the misses of one fetch never share a cache row. Before the first step."""
        if rows < self.retrieval_limit:
            raise ValueError(f"a unit cache needs at least the {self.retrieval_limit} retrieved rows, got {rows}")
        self.cache = RowCache.empty(self.retrieved.keys, rows)
        self._cache_scratch()

    def _cache_scratch(self) -> None:
        shape, like = self.retrieved.keys.shape[:3], self.retrieved.keys
        self.cache_source = _shared(shape, torch.int32, like, fill=-1, purpose="cache source")
        self.cache_dest = _shared(shape, torch.long, like, fill=-1, purpose="cache dest")
        self.unread = _shared(shape[:1], torch.long, like, fill=0, purpose="uncounted")

    def fetch(self, slots: torch.Tensor, slot_valid: torch.Tensor, reselect: torch.Tensor, ops) -> None:
        """Replace the retrieved buffer with ``slots`` for the sequences where ``reselect``.

        In place (fixed buffers, so a captured step replays); rows are read from the pool only
        for sequences that re-select, and only those whose slot neither the buffer nor the unit
        cache already holds (counted in ``pool_rows_read``; ``rows_fetched`` counts them all),
        except where ``read_whole`` and the pool is still in GPU memory (no cache): every row is read.
        """
        buffer, cache = self.retrieved, self.cache
        ops = dispatch.as_ops(ops, buffer.keys.device)
        batch, heads, rows = slots.shape
        # a split placement may have moved the pool to the host since the prefill: then it is looked up
        if self.read_whole and cache is None and self.pool.keys.device == buffer.keys.device:
            ops.fetch_whole(self, slots, slot_valid, reselect)  # the rows, the commit and both counters
            return
        self.rows_fetched.add_(reselect, alpha=heads * rows)  # one launch
        # rows the buffer already holds are copied on the device; only the others are read
        # from the pool (over PCIe for a host pool). Same contents as gathering every row.
        if cache is None:
            ops.resident_rows(slots, reselect, buffer, self.source, self.pool_rows_read, self.slot_map)
            cache_source = None
        else:
            ops.resident_rows(slots, reselect, buffer, self.source, self.unread, self.slot_map)
            ops.resident_rows(slots, reselect, cache, self.cache_source, self.unread, self.slot_map, skip=self.source)
            ops.number_misses(self, reselect)  # counted, and each given the cache row it replaces
            cache_source = self.cache_source
        ops.refresh_rows((self.pool.keys, self.pool.values), slots, reselect, self.source,
                         (buffer.keys, buffer.values), self.scratch,
                         None if cache is None else (cache.keys, cache.values), cache_source, self.pool.zone_rows)
        # the buffer's slots, validity (padding inside a unit is fetched, never attended), fill
        # and held flags (a slot not written yet was read as whatever the pool held: never reused)
        ops.commit_selection(self, slots, slot_valid, reselect)
        if cache is not None:
            ops.cache_insert(cache, self.cache_dest, reselect, buffer)

    def admit(self, evicted: Evicted, reselected: torch.Tensor, ops, evict: bool = False) -> None:
        """Keep a token that left the local window attended while the retrieved buffer has room;
        with ``evict`` (the policy's ``admit="evict"``), a full buffer keeps it too, in place of
        its lowest-ranked selected row (``kept``).

        ``reselected (B,)``: the sequences that re-selected at this step (after their fetch); they
        admit nothing, and ``kept`` restarts from the new selection. In place, by the
        ``admit_row`` kernel op; ``admitted`` counts every token kept, either way.
        """
        if self.retrieval_capacity == 0:
            return
        dispatch.as_ops(ops, self.retrieved.keys.device).admit_row(
            self.retrieved, evicted, reselected, self.kept if evict else None, self.admitted)

    @property
    def attends_pool_by_slot(self) -> bool:
        """Whether the retrieved buffer holds only slots, whose rows attention reads from the pool
        (a pool in the attention device's memory and no unit cache: a fetch then reads every
        row, ``fetch_whole``, and moves none)."""
        return (self.attend_pool and self.read_whole and self.cache is None
                and self.pool.keys.device == self.retrieved.keys.device)

    def stop_attending_pool(self) -> None:
        """Copy the pool rows of the retrieved buffer's slots into it, and from now on fetch rows
        into the buffer: before the pool leaves the attention device (a split placement moving
        it to the host), while its rows can still be read there."""
        if not self.attends_pool_by_slot:
            self.attend_pool = False
            return
        buffer = self.retrieved
        keys, values = reference.with_pool_rows(buffer.keys, buffer.values, self.retrieved_from_pool())
        buffer.keys.copy_(keys)
        buffer.values.copy_(values)
        self.attend_pool = False

    def retrieved_from_pool(self, start: int = 0) -> PoolRows:
        """The retrieved buffer's rows as the pool rows of its slots, placed from row ``start`` of a part."""
        return PoolRows(self.pool.keys, self.pool.values, self.retrieved.slots, start, self.pool.zone_rows,
                        self.zone_end if self.pool.zone_rows is not None else 0)

    def attention_parts(self) -> list[tuple]:
        """The parts a step attends to: the one attended buffer, ``(keys, values, valid)``, with its
        retrieved rows read from the pool (a fourth item, ``PoolRows``) where
        ``attends_pool_by_slot``."""
        part = (self.attended.keys, self.attended.values, self.attended.valid)
        if self.attends_pool_by_slot and self.retrieval_capacity:
            return [(*part, self.retrieved_from_pool(start=self.sink.rows))]
        return [part]

    def forget_resident(self) -> None:
        """Treat no retrieved row as reusable, so the next fetch reads every row from the pool
        (a cold transfer, for benchmarks; in place, so it may run between graph replays)."""
        self.retrieved.held.zero_()
        if self.cache is not None:
            self.cache.held.zero_()

    def local_slots(self) -> torch.Tensor:
        """``(L,)`` the slot each ring position holds (meaningful where ``local.valid``)."""
        capacity = self.local_capacity
        newest = self.next_slot - 1
        position = torch.arange(capacity, device=self.local.valid.device)
        # the ring holds slots (newest - capacity, newest]; slot s sits at s % capacity
        # positions never written yet would map below 0; they are invalid, keep them indexable
        return (newest - ((newest - position) % capacity)).clamp(min=0)

    def attended_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, valid)``, both ``(B, H, S + R + L)``: every token this step attends to."""
        batch, heads = self.retrieved.slots.shape[:2]
        sink = self.sink.slots.clamp(min=0)[:, None, :].expand(batch, heads, -1)
        local = self.local_slots().expand(batch, heads, -1)
        slots = torch.cat([sink, self.retrieved.slots, local], dim=-1)
        valid = torch.cat([self.sink.valid, self.retrieved.valid, self.local.valid], dim=-1)
        return slots, valid

    def device_bytes(self) -> int:
        """KV bytes held on the attention device (sink + local + retrieved, and the unit cache)."""
        cache = 0 if self.cache is None else self.cache.nbytes()
        return sum(tier.nbytes() for tier in (self.sink, self.retrieved, self.local)) + cache

    def full_bytes(self) -> int:
        """Bytes the full KV of the tokens so far takes (what a dense cache would hold)."""
        batch, heads, _, dim = self.pool.keys.shape
        return 2 * batch * heads * self.length * dim * self.pool.keys.element_size()
