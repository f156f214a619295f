"""Issue 15, item 1: the retrieval index grows with units, not tokens.

The unit table reserved one float32 unit (key sum, min and max, D wide each) per generated token
for every builder, pages of 16 included; a tiny Llama at louiskv budget 128 held a 10.3 MiB table
beside 2.3 MiB of full KV after 1,000 tokens. Its decode part now doubles from a bound on the
units opened (``UnitTable`` docstring): under ``2 x`` the rule's bound for pages, under ``3 x`` the
units opened for segments (plus 16), each unit ``unit_bytes(D)`` per (sequence, KV head).
"""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.layer import PolicyLayerState
from kvpolicy.units.table import TOKEN_BYTES, unit_bytes

from conftest import prompt_query

B, H, HQ, D, PROMPT, LOCAL = 1, 2, 4, 16, 200, 16


@pytest.fixture(autouse=True)
def one_thread():
    # a step of these tiny tensors is ~2 ms on one thread; two threads on a loaded 2-core machine
    # spin on every op (11 ms an einsum)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _decode(name: str, steps: int, seed: int = 0) -> PolicyLayerState:
    gen = torch.Generator().manual_seed(seed)
    policy = kvpolicy.preset(name, budget=128, local=LOCAL, backend="reference")
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    state.prefill(torch.randn(B, H, PROMPT, D, generator=gen), torch.randn(B, H, PROMPT, D, generator=gen),
                  torch.ones(B, PROMPT, dtype=torch.bool), HQ, last_query=prompt_query(B, HQ, D))
    # one query direction with a little noise: query_cosine fires now and then, not on every step
    direction = torch.randn(B, HQ, D, generator=gen)
    for _ in range(steps):
        query = direction + 0.2 * torch.randn(B, HQ, D, generator=gen)
        state.decode(query, torch.randn(B, H, D, generator=gen), torch.randn(B, H, D, generator=gen), D**-0.5)
    return state


@pytest.mark.parametrize("name", ["quest", "louiskv"])
def test_index_memory_grows_with_units_not_tokens(name):
    steps = 1200
    state = _decode(name, steps)
    table = state.units
    assert table.decode_tokens == steps  # the prompt filled the window: a token left it every step
    opened = int(table.decode_units.max())
    decode_capacity = table.capacity - table.num_prompt_units
    if name == "quest":  # pages of 16: the rule bounds the units without reading the device
        assert opened == -(-steps // 16)
        assert decode_capacity <= 2 * opened + 16
    else:  # segments: cut where the trigger fired (sometimes) or at 64 tokens
        assert steps // 64 <= opened < steps // 4
        assert decode_capacity <= 3 * (opened + 1) + 16
    # the whole index on the attention device, against its documented per-unit and per-token cost
    order_capacity = table.order.shape[-1]
    assert order_capacity <= PROMPT - LOCAL + 2 * steps + 16
    per_head = unit_bytes(D) * table.capacity + TOKEN_BYTES * order_capacity
    small = sum(t.numel() * t.element_size() for t in (table.open_unit, table.decode_units, table.order_next))
    assert state.index_bytes() == B * H * per_head + small
    # a table of one unit per generated token (what it reserved before) would be several times it
    assert state.index_bytes() * 3 < B * H * unit_bytes(D) * (table.num_prompt_units + steps)


def test_segments_read_the_device_count_rarely_and_reserve_the_worst_case_before_a_capture():
    # the bound of a rule cut at trigger boundaries is the count last read plus one a token; the
    # plan reads it only when that bound reaches the capacity, keeping twice the units opened
    state = _decode("louiskv", 0)
    table = state.units
    reads = []
    real = type(table)._read_units

    def counting(self):
        did = real(self)
        reads.append(did)
        return did

    gen = torch.Generator().manual_seed(1)
    direction = torch.randn(B, HQ, D, generator=gen)
    type(table)._read_units = counting
    try:
        for _ in range(600):
            query = direction + 0.2 * torch.randn(B, HQ, D, generator=gen)
            state.decode(query, torch.randn(B, H, D, generator=gen), torch.randn(B, H, D, generator=gen), D**-0.5)
    finally:
        type(table)._read_units = real
    assert 0 < sum(reads) <= 600 // 8
    # before a capture, reserve makes room for the worst case: a unit per token
    capacity = table.capacity
    table.reserve(100)
    assert table.capacity >= table.num_prompt_units + int(table.decode_units.max()) + 100
    assert table.decode_units_bound(table.decode_tokens + 100) <= table.capacity - table.num_prompt_units
    assert capacity <= table.capacity


def test_a_reserve_before_any_step_is_bounded_by_the_decode_builders_rule():
    # DecodeGraph reserves its steps before the first decode step: the table must already know
    # its decode builder (pages of 16: a unit per 16 tokens, not one per token)
    from test_layer import PROMPT, Run, _policy

    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 2, PROMPT, 16, generator=gen), torch.randn(2, 2, PROMPT, 16, generator=gen)
    run = Run(_policy("quest"), keys, values, torch.ones(2, PROMPT, dtype=torch.bool), prompt_query(2, HQ, D))
    table = run.state.units
    run.state.plan.reserve(1600)
    assert table.start.shape[-1] <= table.num_prompt_units + 1600 // 16 + 16
