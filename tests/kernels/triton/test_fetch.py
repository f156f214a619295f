"""``fetch_whole`` (a GPU pool's re-selection in one launch) on fresh random inputs.

Two stores are laid out alike (a prompt, its zone in a random unit order, some decode tokens),
then fetch the same random selections, one through the reference op and one through Triton:
every retrieved row, slot, flag, fill and counter must match bit for bit, and sequences that do
not re-select must be left as they were. A store that attends the pool by slot moves no row: its
buffer's keys and values stay as they were, the rest is committed alike. Without CUDA the Triton op runs on CPU tensors through
Triton's interpreter (conftest turns it on); with CUDA the same cases run on the GPU.
"""

import pytest
import torch

from kvpolicy.kernels import dispatch
from kvpolicy.kernels.triton import fetch
from kvpolicy.store import TieredStore

from bitwise import random_pool, same_bits

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def _store(gen, batch, heads, prompt, dim, dtype, sink, local, retrieval, zone_order):
    keys = random_pool((batch, heads, prompt, dim), dtype, DEVICE, gen)
    values = random_pool((batch, heads, prompt, dim), dtype, DEVICE, gen)
    valid = torch.ones(batch, prompt, dtype=torch.bool, device=DEVICE)
    valid[-1, :3] = False  # left padding: pool rows that are not real tokens
    store = TieredStore.from_prefill(keys, values, valid, sink, local, retrieval, DEVICE, defer_zone=True)
    zone = store.zone_end
    order = None
    if zone_order:
        order = torch.stack([torch.randperm(zone, generator=gen, device=gen.device) for _ in range(batch * heads)])
        order = order.view(batch, heads, zone).to(DEVICE)
    store.lay_out_zone(keys, values, order)
    return store


def _snapshot(store):
    r = store.retrieved
    return [t.clone() for t in (r.keys, r.values, r.slots, r.valid, r.held, r.fill, store.rows_fetched,
                                store.pool_rows_read)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zone_order", [True, False], ids=["unit-ordered", "row-is-slot"])
@pytest.mark.parametrize("shape", [(2, 3, 96, 16, 40), (3, 2, 200, 24, 100)], ids=["small", "odd-dims"])
# "one tile": a (sequence, head)'s rows in one program at these sizes; "tiles": 256-byte tiles,
# several programs a (sequence, head), so the fill and counters come from tile 0 alone, and the
# fill in steps of 16 flags (the loop past the first block)
@pytest.mark.parametrize("tile_bytes", [fetch._TILE_BYTES, 256], ids=["one-tile", "tiles"])
@pytest.mark.parametrize("by_slot", [False, True], ids=["rows-copied", "attends-pool-by-slot"])
def test_fetch_whole_matches_the_reference_bit_for_bit(dtype, zone_order, shape, tile_bytes, by_slot, monkeypatch):
    monkeypatch.setattr(fetch, "TILE_BYTES", tile_bytes)
    monkeypatch.setattr(fetch, "FILL_BLOCK", fetch.FILL_BLOCK if tile_bytes == fetch._TILE_BYTES else 16)
    monkeypatch.setattr(fetch, "COMMIT_ROWS", 256 if tile_bytes == fetch._TILE_BYTES else 16)
    batch, heads, prompt, dim, retrieval = shape
    seed = hash((str(dtype), zone_order, shape)) % 1000
    stores = []
    for _ in range(2):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        stores.append(_store(gen, batch, heads, prompt, dim, dtype, 2, 8, retrieval, zone_order))
        stores[-1].read_whole, stores[-1].attend_pool = True, by_slot  # as a GPU pool's store, on the CPU too
        assert stores[-1].attends_pool_by_slot == by_slot
    gen = torch.Generator(device=DEVICE).manual_seed(seed + 1)
    for step in range(4):
        key, value = random_pool((2, batch, heads, dim), dtype, DEVICE, gen)
        for store in stores:  # a decode token: a slot past the zone, whose row is the slot
            store.append(key, value, "reference")
        rows = stores[0].retrieved.slots.shape[-1]
        slots = torch.randint(0, stores[0].length + 2, (batch, heads, rows), generator=gen, device=DEVICE)
        slot_valid = torch.rand(batch, heads, rows, generator=gen, device=DEVICE) < 0.8
        slots = torch.where(slot_valid, slots, 0)  # padding at slot 0, as a budget fill leaves it
        reselect = torch.rand(batch, generator=gen, device=DEVICE) < 0.6
        reselect[step % batch] = True
        before = _snapshot(stores[1])
        dispatch.get("fetch_whole", "reference", DEVICE)(stores[0], slots, slot_valid, reselect)
        dispatch.get("fetch_whole", "triton", DEVICE)(stores[1], slots, slot_valid, reselect)
        want, got = _snapshot(stores[0]), _snapshot(stores[1])
        after = list(got)
        # a slot not written yet when fetched reads whatever its pool row held (never attended:
        # not held), and the two stores' pools were allocated apart: compare held rows only
        written = stores[0].retrieved.held.unsqueeze(-1)
        want[:2] = [torch.where(written, t, 0) for t in want[:2]]
        got[:2] = [torch.where(written, t, 0) for t in got[:2]]
        for name, w, g in zip(("keys", "values", "slots", "valid", "held", "fill", "rows_fetched", "read"), want, got):
            same = same_bits(w, g) if w.is_floating_point() else torch.equal(w.cpu(), g.cpu())
            assert same, f"step {step}: {name} differs from the reference"
        unwritten = (slots >= stores[1].length) & reselect.view(-1, 1, 1)
        assert not bool(stores[1].retrieved.held[unwritten].any()), f"step {step}: an unwritten slot is held"
        if by_slot:  # no row moved, for any sequence
            assert same_bits(before[0], after[0]) and same_bits(before[1], after[1]), f"step {step}: a row moved"
        kept = ~reselect.cpu()
        for name, old, new in zip(("keys", "slots", "fill"), (before[0], before[2], before[5]), (after[0], after[2], after[5])):
            assert torch.equal(old.cpu()[kept].view(torch.uint8) if old.is_floating_point() else old.cpu()[kept],
                               new.cpu()[kept].view(torch.uint8) if new.is_floating_point() else new.cpu()[kept]), (
                f"step {step}: {name} of a sequence that kept its selection changed")
    r = stores[1].retrieved
    assert int(stores[1].pool_rows_read.sum()) > 0 and bool(r.held.any()) and bool(r.valid.any())


def test_fetch_whole_refuses_a_host_pool_for_a_gpu_buffer():
    if not CUDA:
        pytest.skip("needs a CUDA device: on a CPU pool and buffer share the device")
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    store = _store(gen, 1, 1, 64, 16, torch.bfloat16, 2, 8, 16, False)
    store.pool.keys = store.pool.keys.cpu().pin_memory()
    slots = torch.zeros(1, 1, store.retrieved.slots.shape[-1], dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match="must be on the buffer's device"):
        dispatch.get("fetch_whole", "triton", DEVICE)(store, slots, slots >= 0, torch.ones(1, dtype=torch.bool, device=DEVICE))
