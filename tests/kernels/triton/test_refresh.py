"""``refresh_rows`` (and ``resident_rows``, which finds the rows it may reuse) on fresh random inputs.

A refresh must give exactly what a plain gather from the pool gives, as long as the rows it
reuses hold their slot's pool row; rows not marked held must never be reused. Without CUDA the
Triton op runs on CPU tensors through Triton's interpreter (conftest turns it on); with CUDA
the same cases run on the GPU, plus pinned-host-pool cases at a real decode's size.
"""

import pytest
import torch

from kvpolicy.kernels import dispatch, reference
from kvpolicy.tiers import RetrievedBuffer

from bitwise import BITS as _BITS
from bitwise import random_pool as _random_pool
from bitwise import same_bits as _same_bits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
BACKENDS = ["reference", "triton"]



def _refresh(backend):
    """``refresh_rows`` of one part: ``(pool, slots, take, source, out, scratch[, cache, cache_source])``."""
    op = dispatch.get("refresh_rows", backend, DEVICE)

    def one_part(pool, slots, take, source, out, scratch, cache=None, cache_source=None):
        op((pool,), slots, take, source, (out,), (scratch,), None if cache is None else (cache,), cache_source)

    return one_part


def _slot_map(slots, current):
    """The all -1 scratch map ``resident_rows`` needs: one entry past every slot of either."""
    top = max([int(t.max()) for t in (slots, current) if t.numel()] + [0])
    return torch.full((*slots.shape[:2], top + 1), -1, dtype=torch.int32, device=slots.device)


def _locate(backend, slots, take, current, held):
    """``resident_rows`` into fresh outputs: ``(source, rows_read)``; the slot map must come back all -1."""
    source = torch.full(slots.shape, -7, dtype=torch.int32, device=slots.device)  # -7: "untouched"
    rows_read = torch.full((slots.shape[0],), 5, dtype=torch.long, device=slots.device)
    slot_map = _slot_map(slots, current)
    dispatch.get("resident_rows", backend, DEVICE)(slots, take, _buffer(current, held), source, rows_read, slot_map)
    assert (slot_map == -1).all(), "resident_rows left marks in the slot map"
    return source, rows_read - 5


def _buffer(current: torch.Tensor, held: torch.Tensor) -> RetrievedBuffer:
    """A retrieved buffer labelled ``current`` (held where ``held``); resident_rows reads no rows."""
    rows = current.new_zeros(*current.shape, 0, dtype=torch.float32)
    return RetrievedBuffer(rows, rows, held, slots=current, held=held, fill=current.new_zeros(current.shape[:2]))






def _current_buffer(pool, slots, held, device):
    """A retrieved buffer labelled ``slots``: the pool's rows where ``held``, garbage elsewhere."""
    out = reference.gather_rows(pool, slots, device).clone()
    out.view(_BITS[out.dtype])[~held.to(device)] = 0x3C3C  # not any pool row, so reuse would show
    return out


def _selection(kind, current, cap, generator):
    """A new ``(B, H, R)`` selection: ``overlap`` mixes current and fresh slots, ``disjoint`` has
    none of the current ones, ``repeats`` draws few distinct slots (repeated, like padding)."""
    batch, heads, rows = current.shape
    device = current.device
    if kind == "overlap":
        fresh = torch.randint(0, cap, (batch, heads, rows), generator=generator, device=device)
        pick = torch.randint(0, 2 * rows, (batch, heads, rows), generator=generator, device=device)
        return torch.cat([current, fresh], dim=-1).gather(-1, pick)
    if kind == "disjoint":
        # the current slots are drawn from [0, cap // 2): take the other half
        return torch.randint(cap // 2, cap, (batch, heads, rows), generator=generator, device=device)
    if kind == "repeats":
        return torch.randint(0, 3, (batch, heads, rows), generator=generator, device=device)
    raise ValueError(kind)


def _case(kind, dtype=torch.float32, dim=64, batch=3, heads=2, cap=80, rows=37, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    pool = _random_pool((batch, heads, cap, dim), dtype, DEVICE, g)
    high = cap // 2 if kind == "disjoint" else cap
    current = torch.randint(0, high, (batch, heads, rows), generator=g, device=DEVICE)
    if kind == "repeats":
        current = torch.randint(0, 3, (batch, heads, rows), generator=g, device=DEVICE)
    held = torch.rand(batch, heads, rows, generator=g, device=DEVICE) < 0.7
    out = _current_buffer(pool, current, held, DEVICE)
    slots = _selection(kind, current, cap, g)
    take = torch.tensor([True, False, True][:batch], device=DEVICE)
    return pool, current, held, out, slots, take


def _brute_force_source(slots, current, held):
    """The last row of the current buffer that holds the slot (an ``(R, R')`` match), else -1."""
    match = (slots.unsqueeze(-1) == current.unsqueeze(-2)) & held.unsqueeze(-2) & (slots >= 0).unsqueeze(-1)
    rows = torch.arange(current.shape[-1], device=slots.device)
    return torch.where(match, rows, -1).amax(-1).int()


# ---- resident_rows -------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["overlap", "disjoint", "repeats"])
def test_resident_rows_finds_the_last_holding_row(backend, kind):
    _, current, held, _, slots, take = _case(kind, seed=1)
    source, read = _locate(backend, slots, take, current, held)
    want = _brute_force_source(slots, current, held)
    assert torch.equal(source[take], want[take])
    assert (source[~take] == -7).all()  # sequences that do not take: untouched
    assert torch.equal(read, torch.where(take, (want < 0).flatten(1).sum(-1), 0))
    found = want[take] >= 0
    if kind == "disjoint":
        assert not found.any()
    if kind == "overlap":
        assert found.float().mean() > 0.3  # the case really exercises reuse


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_never_reuses_unheld_rows_or_matches_negative_slots(backend):
    current = torch.tensor([[[4, 7, 0, 0, 4]]], device=DEVICE)
    held = torch.tensor([[[True, False, False, False, False]]], device=DEVICE)
    slots = torch.tensor([[[7, 4, 0, -1, 9]]], device=DEVICE)
    take = torch.ones(1, dtype=torch.bool, device=DEVICE)
    source, read = _locate(backend, slots, take, current, held)
    assert source.tolist() == [[[-1, 0, -1, -1, -1]]] and read.tolist() == [4]
    # a buffer of unheld rows reuses nothing; an empty buffer neither
    source, _ = _locate(backend, slots, take, current, torch.zeros_like(held))
    assert (source == -1).all()
    empty = torch.zeros(1, 1, 0, dtype=torch.long, device=DEVICE)
    source, read = _locate(backend, slots, take, empty, empty.bool())
    assert (source == -1).all() and read.tolist() == [5]


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_over_many_buffer_rows(backend):
    # more buffer rows than one slot-map tile (256), and more than the wanted rows
    g = torch.Generator(device=DEVICE).manual_seed(9)
    current = torch.randint(0, 600, (2, 2, 300), generator=g, device=DEVICE)
    held = torch.rand(2, 2, 300, generator=g, device=DEVICE) < 0.9
    slots = torch.randint(0, 600, (2, 2, 150), generator=g, device=DEVICE)
    take = torch.ones(2, dtype=torch.bool, device=DEVICE)
    source, read = _locate(backend, slots, take, current, held)
    want = _brute_force_source(slots, current, held)
    assert torch.equal(source, want)
    assert torch.equal(read, (want < 0).flatten(1).sum(-1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_with_runs_of_nothing_to_look_up(backend):
    # slots of -1 (nothing to look up): a run of them, and a whole (sequence, head)
    g = torch.Generator(device=DEVICE).manual_seed(11)
    current = torch.randint(0, 400, (2, 2, 256), generator=g, device=DEVICE)
    held = torch.rand(2, 2, 256, generator=g, device=DEVICE) < 0.9
    slots = torch.randint(0, 400, (2, 2, 200), generator=g, device=DEVICE)
    slots[:, :, :64] = -1  # a run with nothing to find
    slots[1, 1] = -1  # and a whole (sequence, head)
    take = torch.ones(2, dtype=torch.bool, device=DEVICE)
    source, read = _locate(backend, slots, take, current, held)
    want = _brute_force_source(slots, current, held)
    assert torch.equal(source, want)
    assert torch.equal(read, (want < 0).flatten(1).sum(-1))
    assert (want[0, 0, 64:] >= 0).any()


# ---- refresh_rows --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["overlap", "disjoint", "repeats"])
def test_refresh_equals_a_plain_gather(backend, kind):
    pool, current, held, out, slots, take = _case(kind, seed=2)
    source, _ = _locate("reference", slots, take, current, held)
    before = out.clone()
    want = out.clone()
    reference.gather_rows_into(pool, slots, take, want)
    _refresh(backend)(pool, slots, take, source, out, torch.empty_like(out))
    assert _same_bits(out, want)
    assert _same_bits(out[~take], before[~take])  # skipped sequences untouched, garbage rows included


@pytest.mark.parametrize("dim", [64, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_refresh_matches_the_reference_bit_for_bit(dtype, dim):
    pool, current, held, out, slots, take = _case("overlap", dtype=dtype, dim=dim, seed=3)
    source, _ = _locate("reference", slots, take, current, held)
    want = out.clone()
    _refresh("reference")(pool, slots, take, source, want, torch.empty_like(out))
    _refresh("triton")(pool, slots, take, source, out, torch.empty_like(out))
    assert _same_bits(out, want)


@pytest.mark.parametrize("with_cache", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_of_keys_and_values_in_one_call_equals_one_call_each(backend, with_cache):
    pool, current, held, out, slots, take = _case("overlap", dtype=torch.bfloat16, seed=13)
    values_pool = pool.flip(2).contiguous()  # other contents, same layout
    values_out = _current_buffer(values_pool, current, held, DEVICE)
    source, _ = _locate("reference", slots, take, current, held)
    g = torch.Generator(device=DEVICE).manual_seed(14)
    caches, cache_source = None, None
    if with_cache:
        caches = tuple(torch.randn(*pool.shape[:2], 9, pool.shape[-1], generator=g, device=DEVICE).to(pool.dtype)
                       for _ in range(2))
        cache_source = torch.randint(-1, 9, slots.shape, generator=g, device=DEVICE, dtype=torch.int32)
    want = [out.clone(), values_out.clone()]
    for part, (p, w) in enumerate(zip((pool, values_pool), want)):
        _refresh("reference")(p, slots, take, source, w, torch.empty_like(w),
                              None if caches is None else caches[part], cache_source)
    got = [out.clone(), values_out.clone()]
    dispatch.get("refresh_rows", backend, DEVICE)((pool, values_pool), slots, take, source, got,
                                                  [torch.empty_like(out), torch.empty_like(out)], caches, cache_source)
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])
    assert not _same_bits(want[0], want[1])  # the parts really differ


@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_reads_the_zone_through_its_row_map(backend):
    # slots of the prompt's zone are read at zone_rows[slot]; later slots at their own row
    pool, current, held, out, slots, take = _case("disjoint", seed=16)
    zone = 50
    g = torch.Generator(device=DEVICE).manual_seed(17)
    zone_rows = torch.stack([torch.randperm(zone, generator=g, device=DEVICE) for _ in range(6)])
    zone_rows = zone_rows.view(3, 2, zone).int()
    source, _ = _locate("reference", slots, take, current, held)
    want = out.clone()
    reference.gather_rows_into(pool, reference.pool_rows(slots, zone_rows), take, want)
    dispatch.get("refresh_rows", backend, DEVICE)((pool,), slots, take, source, (out,), (torch.empty_like(out),),
                                                  None, None, zone_rows)
    assert _same_bits(out, want)
    in_zone = (slots < zone) & (source < 0) & take.view(-1, 1, 1)
    assert in_zone.any() and ((slots >= zone) & (source < 0)).any()  # both kinds of row are read
    assert (zone_rows.long() != torch.arange(zone, device=DEVICE)).any()  # the map is not the identity


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_skips_rows_found_elsewhere(backend):
    _, current, held, _, slots, take = _case("overlap", seed=18)
    g = torch.Generator(device=DEVICE).manual_seed(19)
    skip = torch.randint(-1, 3, slots.shape, generator=g, device=DEVICE, dtype=torch.int32)
    source = torch.full(slots.shape, -7, dtype=torch.int32, device=DEVICE)
    read = torch.zeros(slots.shape[0], dtype=torch.long, device=DEVICE)
    slot_map = _slot_map(slots, current)
    dispatch.get("resident_rows", backend, DEVICE)(slots, take, _buffer(current, held), source, read, slot_map,
                                                   skip=skip)
    want, want_read = _locate("reference", torch.where(skip >= 0, -1, slots), take, current, held)
    assert torch.equal(source, want) and torch.equal(read, want_read) and (slot_map == -1).all()
    assert ((skip >= 0) & (_brute_force_source(slots, current, held) >= 0)).any()  # skips rows it would find


def test_triton_refresh_rejects_parts_that_do_not_pair_up():
    pool, current, held, out, slots, take = _case("overlap", seed=15)
    source, _ = _locate("reference", slots, take, current, held)
    op = dispatch.get("refresh_rows", "triton", DEVICE)
    with pytest.raises(ValueError, match="sequences of parts"):
        op(pool, slots, take, source, out, torch.empty_like(out))
    with pytest.raises(ValueError, match="one or two parts"):
        op((pool, pool), slots, take, source, (out,), (torch.empty_like(out),))
    with pytest.raises(ValueError, match="share shape"):
        op((pool, pool[:, :, :-1]), slots, take, source, (out, out.clone()), (torch.empty_like(out),) * 2)
    shared = torch.empty_like(out)
    with pytest.raises(ValueError, match="shares memory"):
        op((pool, pool), slots, take, source, (out, out.clone()), (shared, shared))


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_come_from_the_buffer_not_the_pool(backend):
    pool, current, held, out, slots, take = _case("overlap", seed=4)
    source, _ = _locate("reference", slots, take, current, held)
    want = out.clone()
    reference.gather_rows_into(pool, slots, take, want)
    # poison the pool rows the buffer holds: a refresh must not read them
    resident_slots = torch.where(source >= 0, slots, -1)
    poisoned = pool.clone()
    for b, h in ((b, h) for b in range(pool.shape[0]) for h in range(pool.shape[1])):
        gone = resident_slots[b, h][resident_slots[b, h] >= 0].unique()
        poisoned.view(_BITS[pool.dtype])[b, h, gone] = 0x1234
    _refresh(backend)(poisoned, slots, take, source, out, torch.empty_like(out))
    assert _same_bits(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_refresh_with_no_sequence_taking_moves_nothing(backend):
    pool, current, held, out, slots, _ = _case("overlap", seed=5)
    take = torch.zeros(3, dtype=torch.bool, device=DEVICE)
    source, read = _locate(backend, slots, take, current, held)
    assert (source == -7).all() and (read == 0).all()
    source.fill_(-1)  # as a store leaves it
    before = out.clone()
    _refresh(backend)(pool, slots, take, source, out, torch.empty_like(out))
    assert _same_bits(out, before)


def test_triton_refresh_takes_strided_inputs():
    g = torch.Generator(device=DEVICE).manual_seed(6)
    # heads interleaved in memory, slots and source transposed views, D not a power of two
    pool = _random_pool((2, 40, 3, 48), torch.float32, DEVICE, g).transpose(1, 2)
    current = torch.randint(0, 40, (2, 9, 3), generator=g, device=DEVICE).transpose(1, 2)
    held = torch.ones(2, 3, 9, dtype=torch.bool, device=DEVICE)
    out = reference.gather_rows(pool, current, DEVICE)
    slots = torch.randint(0, 40, (2, 9, 3), generator=g, device=DEVICE).transpose(1, 2)
    take = torch.ones(2, dtype=torch.bool, device=DEVICE)
    source, _ = _locate("triton", slots, take, current, held)
    source = source.transpose(1, 2).contiguous().transpose(1, 2)
    _refresh("triton")(pool, slots, take, source, out, torch.empty_like(out))
    assert _same_bits(out, reference.gather_rows(pool, slots, DEVICE))


def test_triton_refresh_refuses_a_scratch_that_is_the_buffer():
    pool, current, held, out, slots, take = _case("overlap", seed=7)
    source, _ = _locate("reference", slots, take, current, held)
    with pytest.raises(ValueError, match="scratch"):
        _refresh("triton")(pool, slots, take, source, out, out)
    with pytest.raises(ValueError, match="scratch"):
        _refresh("triton")(pool, slots, take, source, out, torch.empty_like(out, dtype=torch.float16))


# ---- the GPU unit cache: refresh_rows reading it, cache_insert filling it --------------------


def _cache_case(dtype, dim, seed, cache_rows=23):
    """A refresh case with a cache: random cache rows, and a ``cache_source`` naming one for
    about half the rows the buffer lacks (-1 for the rest)."""
    pool, current, held, out, slots, take = _case("overlap", dtype=dtype, dim=dim, seed=seed)
    g = torch.Generator(device=DEVICE).manual_seed(seed + 100)
    batch, heads, rows = slots.shape
    cache = _random_pool((batch, heads, cache_rows, dim), dtype, DEVICE, g)
    source, _ = _locate("reference", slots, take, current, held)
    named = torch.randint(0, cache_rows, slots.shape, generator=g, device=DEVICE, dtype=torch.int32)
    use = (source < 0) & (torch.rand(slots.shape, generator=g, device=DEVICE) < 0.5)
    cache_source = torch.where(use, named, -1)
    return pool, out, slots, take, source, cache, cache_source


def _refresh_by_hand(pool, out, slots, take, source, cache, cache_source):
    """The buffer row, else the cache row, else the pool row, row by row (not the ops' code)."""
    want = out.clone()
    for b, h, r in ((b, h, r) for b in range(slots.shape[0]) for h in range(slots.shape[1]) for r in range(slots.shape[2])):
        if not take[b]:
            continue
        if source[b, h, r] >= 0:
            want[b, h, r] = out[b, h, source[b, h, r]]
        elif cache_source[b, h, r] >= 0:
            want[b, h, r] = cache[b, h, cache_source[b, h, r]]
        else:
            want[b, h, r] = pool[b, h, slots[b, h, r]]
    return want


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 64), (torch.bfloat16, 48), (torch.float16, 64)])
def test_refresh_reads_cached_rows_from_the_cache(backend, dtype, dim):
    pool, out, slots, take, source, cache, cache_source = _cache_case(dtype, dim, seed=11)
    want = _refresh_by_hand(pool, out, slots, take, source, cache, cache_source)
    # poison the pool rows the cache supplies: a refresh must not read them
    poisoned = pool.clone()
    cached_slots = torch.where(cache_source >= 0, slots, -1)
    for b, h in ((b, h) for b in range(pool.shape[0]) for h in range(pool.shape[1])):
        gone = cached_slots[b, h][cached_slots[b, h] >= 0].unique()
        keep = slots[b, h][(cache_source[b, h] < 0) & (source[b, h] < 0)]
        gone = gone[~torch.isin(gone, keep)]  # a slot listed twice may also come from the pool
        poisoned.view(_BITS[dtype])[b, h, gone] = 0x1234
    _refresh(backend)(poisoned, slots, take, source, out, torch.empty_like(out), cache, cache_source)
    assert _same_bits(out, want)


def test_triton_refresh_refuses_a_cache_that_does_not_fit():
    pool, out, slots, take, source, cache, cache_source = _cache_case(torch.float32, 64, seed=12)
    with pytest.raises(ValueError, match="cache"):
        _refresh("triton")(pool, slots, take, source, out, torch.empty_like(out), cache[..., :32], cache_source)
    with pytest.raises(ValueError, match="cache"):
        _refresh("triton")(pool, slots, take, source, out, torch.empty_like(out), cache, cache_source.long())


def _insert_case(seed, dtype=torch.float32, dim=48, batch=3, heads=2, rows=19, cache_rows=31):
    from kvpolicy.tiers import RowCache

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    keys = _random_pool((batch, heads, rows, dim), dtype, DEVICE, g)
    values = _random_pool((batch, heads, rows, dim), dtype, DEVICE, g)
    buffer = RetrievedBuffer(keys, values, torch.ones(batch, heads, rows, dtype=torch.bool, device=DEVICE),
                             slots=torch.randint(0, 500, (batch, heads, rows), generator=g, device=DEVICE),
                             held=torch.rand(batch, heads, rows, generator=g, device=DEVICE) < 0.8,
                             fill=torch.zeros(batch, heads, dtype=torch.long, device=DEVICE))
    cache = RowCache.empty(keys, cache_rows)
    cache.keys.copy_(_random_pool(cache.keys.shape, dtype, DEVICE, g))
    cache.values.copy_(_random_pool(cache.values.shape, dtype, DEVICE, g))
    cache.slots.copy_(torch.randint(0, 500, cache.slots.shape, generator=g, device=DEVICE))
    cache.held.copy_(torch.rand(cache.held.shape, generator=g, device=DEVICE) < 0.5)
    # distinct destinations per (sequence, head), about a third of the rows filed
    dest = torch.stack([torch.randperm(cache_rows, generator=g, device=DEVICE)[:rows] for _ in range(batch * heads)])
    dest = dest.view(batch, heads, rows)
    dest = torch.where(torch.rand(dest.shape, generator=g, device=DEVICE) < 0.35, dest, -1)
    take = torch.tensor([True, False, True][:batch], device=DEVICE)
    return cache, dest, take, buffer


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_cache_insert_files_rows_where_told(backend, seed):
    cache, dest, take, buffer = _insert_case(seed)
    want = {name: getattr(cache, name).clone() for name in ("keys", "values", "slots", "held")}
    for b, h, r in ((b, h, r) for b in range(dest.shape[0]) for h in range(dest.shape[1]) for r in range(dest.shape[2])):
        at = int(dest[b, h, r])
        if take[b] and at >= 0:
            for name in want:
                want[name][b, h, at] = getattr(buffer, name)[b, h, r]
    assert int(((dest >= 0) & take.view(-1, 1, 1)).sum()) > 0  # the case files something
    dispatch.get("cache_insert", backend, DEVICE)(cache, dest, take, buffer)
    for name, expected in want.items():
        got = getattr(cache, name)
        assert (_same_bits(got, expected) if got.is_floating_point() else torch.equal(got, expected)), name


def test_dispatch_reaches_the_triton_refresh():
    from kvpolicy.kernels.triton import refresh

    for op in ("resident_rows", "refresh_rows", "cache_insert"):
        assert dispatch.why_unavailable("triton", op, DEVICE) is None
        assert dispatch.get(op, "triton", DEVICE) is getattr(refresh, op)


# ---- CUDA only: a pool in pinned host memory, a decode's size ------------------------------

_HOST_SHAPE = (2, 8, 131072, 128)
_R = 2048


@pytest.fixture(scope="module")
def pinned_pool():
    return _random_pool(_HOST_SHAPE, torch.bfloat16, "cpu", torch.Generator(device="cuda").manual_seed(0), pin=True)


def _pinned_case(pool, seed, share):
    """A current buffer of ``_R`` held rows and a selection sharing about ``share`` of them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    batch, heads, cap, _ = pool.shape
    current = torch.stack([torch.randperm(cap, generator=g, device="cuda")[:_R] for _ in range(batch * heads)])
    current = current.view(batch, heads, _R)
    fresh = torch.randint(0, cap, (batch, heads, _R), generator=g, device="cuda")
    keep = torch.rand(batch, heads, _R, generator=g, device="cuda") < share
    slots = torch.where(keep, current.gather(-1, torch.randperm(_R, generator=g, device="cuda").expand_as(current)), fresh)
    held = torch.ones_like(current, dtype=torch.bool)
    out = reference.gather_rows(pool, current.cpu(), torch.device("cpu")).cuda()
    return current, held, out, slots


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_over_a_unit_cache_of_thousands_of_rows(backend):
    # a GPU unit cache holds more rows than the buffer: more than the old all-pairs limit (4,096),
    # with labels repeated so the last holding row must win
    g = torch.Generator(device=DEVICE).manual_seed(12)
    current = torch.randint(0, 3000, (2, 1, 5000), generator=g, device=DEVICE)
    held = torch.rand(2, 1, 5000, generator=g, device=DEVICE) < 0.8
    slots = torch.randint(-1, 6000, (2, 1, 700), generator=g, device=DEVICE)
    take = torch.tensor([True, False], device=DEVICE)
    source, read = _locate(backend, slots, take, current, held)
    want = _brute_force_source(slots, current, held)
    assert torch.equal(source[take], want[take]) and (source[~take] == -7).all()
    assert torch.equal(read, torch.where(take, (want < 0).flatten(1).sum(-1), 0))
    assert (want[0] >= 0).float().mean() > 0.3


def test_triton_resident_rows_never_answers_a_row_a_stale_map_names():
    # a map left dirty (a call cut short between its mark and clear launches) may cost misses,
    # never a row that does not hold the slot
    _, current, held, _, slots, take = _case("overlap", seed=20)
    g = torch.Generator(device=DEVICE).manual_seed(21)
    stale = _slot_map(slots, current)
    # stale rows that exist in the buffer, so only the label check can refuse them
    stale.copy_(torch.randint(-1, current.shape[-1], stale.shape, generator=g, device=DEVICE, dtype=torch.int32))
    source = torch.full(slots.shape, -7, dtype=torch.int32, device=DEVICE)
    read = torch.zeros(slots.shape[0], dtype=torch.long, device=DEVICE)
    dispatch.get("resident_rows", "triton", DEVICE)(slots, take, _buffer(current, held), source, read, stale)
    want = _brute_force_source(slots, current, held)
    got = source[take]
    assert ((got == want[take]) | (got == -1)).all()
    assert (got >= 0).any()  # marked slots are still found


@pytest.mark.parametrize("backend", BACKENDS)
def test_resident_rows_rejects_a_skip_that_is_not_rows(backend):
    _, current, held, _, slots, take = _case("overlap", seed=22)
    source = torch.full(slots.shape, -1, dtype=torch.int32, device=DEVICE)
    read = torch.zeros(slots.shape[0], dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="skip"):
        dispatch.get("resident_rows", backend, DEVICE)(slots, take, _buffer(current, held), source, read,
                                                       _slot_map(slots, current), skip=slots >= 0)


def test_triton_resident_rows_rejects_a_slot_map_that_does_not_fit():
    _, current, held, _, slots, take = _case("overlap", seed=10)
    source = torch.full(slots.shape, -1, dtype=torch.int32, device=DEVICE)
    read = torch.zeros(slots.shape[0], dtype=torch.long, device=DEVICE)
    op = dispatch.get("resident_rows", "triton", DEVICE)
    for bad in (torch.full((1, *slots.shape[1:2], 100), -1, dtype=torch.int32, device=DEVICE),
                torch.full((*slots.shape[:2], 100), -1, dtype=torch.long, device=DEVICE)):
        with pytest.raises(ValueError, match="slot_map"):
            op(slots, take, _buffer(current, held), source, read, bad)


@needs_cuda
@pytest.mark.parametrize("share", [0.0, 0.8, 1.0])
def test_triton_refresh_from_a_pinned_host_pool(pinned_pool, share):
    current, held, out, slots = _pinned_case(pinned_pool, seed=int(share * 10), share=share)
    take = torch.tensor([True, False], device="cuda")
    before = out.clone()
    source, read = _locate("triton", slots, take, current, held)
    want_source, want_read = _locate("reference", slots, take, current, held)
    assert torch.equal(source, want_source) and torch.equal(read, want_read)
    _refresh("triton")(pinned_pool, slots, take, source, out, torch.empty_like(out))
    rows = reference.gather_rows(pinned_pool, slots.cpu(), torch.device("cpu")).cuda()
    assert _same_bits(out[take], rows[take])
    assert torch.equal(out[~take], before[~take])
    if share == 1.0:
        assert (source[take] >= 0).all() and read.tolist() == [0, 0]
    if share == 0.0:
        assert read[0] > 0.95 * _HOST_SHAPE[1] * _R  # a few fresh draws may hit the buffer


@needs_cuda
def test_pinned_refresh_replays_in_a_cuda_graph(pinned_pool):
    current, held, out, slots = _pinned_case(pinned_pool, seed=21, share=0.5)
    take = torch.ones(2, dtype=torch.bool, device="cuda")
    scratch = torch.empty_like(out)
    source = torch.full(slots.shape, -1, dtype=torch.int32, device="cuda")
    rows_read = torch.zeros(2, dtype=torch.long, device="cuda")
    slot_map = torch.full((*slots.shape[:2], pinned_pool.shape[2]), -1, dtype=torch.int32, device="cuda")

    def step():
        dispatch.get("resident_rows", "triton", DEVICE)(slots, take, _buffer(current, held), source, rows_read,
                                                        slot_map)
        _refresh("triton")(pinned_pool, slots, take, source, out, scratch)
        current.copy_(torch.where(take.view(-1, 1, 1), slots, current))

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        g = torch.Generator(device="cuda").manual_seed(200 + seed)
        # half the next selection repeats the buffer's slots
        fresh = torch.randint(0, pinned_pool.shape[2], slots.shape, generator=g, device="cuda")
        slots.copy_(torch.where(torch.rand(slots.shape, generator=g, device="cuda") < 0.5, current, fresh))
        take.copy_(torch.tensor([True, seed != 1], device="cuda"))
        expected = out.clone()
        reference.gather_rows_into(pinned_pool, slots, take, expected)
        _, want_read = _locate("reference", slots, take, current, held)
        before_read = rows_read.clone()
        graph.replay()
        assert _same_bits(out, expected)
        assert torch.equal(rows_read - before_read, want_read)
    assert (slot_map == -1).all()  # each replay clears the marks it made


@pytest.mark.parametrize("rows", [5, 1500, 5000])  # one block; one of 2,048; past one (4,096)
def test_triton_number_misses_matches_the_reference(rows):
    from types import SimpleNamespace

    g = torch.Generator(device=DEVICE).manual_seed(rows)
    shape = (3, 2, rows)

    def store():
        return SimpleNamespace(
            source=torch.randint(-1, 2, shape, generator=g, device=DEVICE, dtype=torch.int32),
            cache_source=torch.randint(-1, 2, shape, generator=g, device=DEVICE, dtype=torch.int32),
            cache_dest=torch.full(shape, 9, dtype=torch.long, device=DEVICE),
            pool_rows_read=torch.tensor([3, 4, 5], device=DEVICE),
            cache=SimpleNamespace(cursor=torch.randint(0, 700, shape[:2], generator=g, device=DEVICE), rows=701),
        )

    want = store()
    got = SimpleNamespace(**{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in vars(want).items()})
    got.cache = SimpleNamespace(cursor=want.cache.cursor.clone(), rows=want.cache.rows)
    reselect = torch.tensor([True, False, True], device=DEVICE)
    reference.number_misses(want, reselect)
    dispatch.get("number_misses", "triton", DEVICE)(got, reselect)
    for name in ("cache_dest", "pool_rows_read"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert torch.equal(got.cache.cursor, want.cache.cursor)
    assert (want.cache_dest[0] >= 0).any() and (want.cache_dest[1] == -1).all()
