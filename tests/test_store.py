"""The tiers hold every token exactly once where the budget allows, and never more than the budget."""

import pytest
import torch

import kvpolicy
from kvpolicy.integrations.transformers import cache_argument_name


def _decode_and_observe(model, policy, prompt_len=150, steps=40, pad=5):
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, prompt_len))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    seen = []

    def observer(state, query):
        slots, valid = state.store.attended_slots()
        seen.append((state.layer_idx, state.store.length, slots.clone(), valid.clone(), state.store.slot_valid.clone()))

    with policy.apply(model) as session, torch.inference_mode():
        cache = session.new_cache()
        for layer in cache.policy_layers():
            layer.observers.append(observer)
        kw = {cache_argument_name(model): cache}
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, **kw)
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            out = model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=mask, use_cache=True, **kw)
    return seen


@pytest.mark.parametrize("name", ["quest", "louiskv", "clusterkv", "arkvale", "pariskv"])
def test_full_budget_attends_every_valid_token_exactly_once(tiny_model_factory, name):
    tiny_llama = tiny_model_factory("llama")
    seen = _decode_and_observe(tiny_llama, kvpolicy.preset(name, budget=400))
    assert seen
    for _, length, slots, valid, slot_valid in seen:
        for b in range(slots.shape[0]):
            for h in range(slots.shape[1]):
                attended = sorted(slots[b, h][valid[b, h]].tolist())
                expected = torch.nonzero(slot_valid[b, :length]).flatten().tolist()
                assert attended == expected


@pytest.mark.parametrize("name", ["quest", "louiskv", "streaming", "pariskv"])
def test_small_budget_attends_at_most_the_budget_and_only_real_tokens(tiny_model_factory, name):
    tiny_llama = tiny_model_factory("llama")
    budget = 100
    seen = _decode_and_observe(tiny_llama, kvpolicy.preset(name, budget=budget))
    for _, length, slots, valid, slot_valid in seen:
        assert (valid.sum(-1) <= budget).all()
        for b in range(slots.shape[0]):
            attended = slots[b][valid[b]]
            assert (attended < length).all()
            assert slot_valid[b, attended].all()
        for b in range(slots.shape[0]):
            for h in range(slots.shape[1]):
                picked = slots[b, h][valid[b, h]].tolist()
                assert len(picked) == len(set(picked))


def test_a_prompt_shorter_than_the_window_keeps_its_sink():
    # issue: zone_end = 0 left the sink empty, so the first tokens dropped once the output
    # passed the window (streaming became a plain sliding window)
    from kvpolicy.layer import PolicyLayerState
    import kvpolicy

    gen = torch.Generator().manual_seed(0)
    batch, heads, dim, prompt, local = 2, 2, 8, 6, 16
    policy = kvpolicy.preset("streaming", budget=4 + local, sink=4, local=local)
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    valid[1, :3] = False  # left padding: sequence 1 has 3 prompt tokens, so one sink row stays empty
    state.prefill(torch.randn(batch, heads, prompt, dim, generator=gen),
                  torch.randn(batch, heads, prompt, dim, generator=gen), valid, heads)
    for _ in range(40):
        state.decode(torch.randn(batch, heads, dim, generator=gen), torch.randn(batch, heads, dim, generator=gen),
                     torch.randn(batch, heads, dim, generator=gen), dim ** -0.5)
    store = state.store
    slots, attended = store.attended_slots()
    wanted_sinks = [{0, 1, 2, 3}, {3, 4, 5}]
    newest = prompt + 40 - 1
    for b in range(batch):
        seen = set(slots[b, 0][attended[b, 0]].tolist())
        window = set(range(newest - local + 1, newest + 1))
        assert seen == wanted_sinks[b] | window, f"sequence {b}"
    assert store.sink_valid.tolist() == [[True] * 4, [True, True, True, False]]


def test_a_budget_past_the_context_allocates_only_what_can_be_retrieved():
    # issue: --budget 100000 on a 42-token prompt allocated every layer's buffers at the full
    # budget (2.56 GB); the retrieved tier now holds at most the tokens outside the local window,
    # grown by the step's plan as tokens leave it, up to the budget
    from kvpolicy.layer import PolicyLayerState
    import kvpolicy

    gen = torch.Generator().manual_seed(1)
    batch, heads, dim, prompt, local = 1, 2, 8, 42, 16
    policy = kvpolicy.preset("quest", budget=100_000, local=local, backend="reference")
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    state.prefill(torch.randn(batch, heads, prompt, dim, generator=gen),
                  torch.randn(batch, heads, prompt, dim, generator=gen), torch.ones(batch, prompt, dtype=torch.bool), heads)
    store = state.store
    assert store.retrieval_limit == 100_000 - 4 - local
    assert store.retrieval_capacity == prompt + 1 - local
    for step in range(60):
        state.decode(torch.randn(batch, heads, dim, generator=gen), torch.randn(batch, heads, dim, generator=gen),
                     torch.randn(batch, heads, dim, generator=gen), dim ** -0.5)
        outside = store.length - local
        assert outside <= store.retrieval_capacity <= 2 * outside + 1
    # every token is attended: the buffer grew with the sequence and nothing was dropped
    slots, attended = store.attended_slots()
    assert set(slots[0, 0][attended[0, 0]].tolist()) == set(range(prompt + 60))
