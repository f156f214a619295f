"""The tiers hold every token exactly once where the budget allows, and never more than the budget."""

import pytest
import torch

import kvpolicy
from kvpolicy.integrations.transformers import cache_argument_name

from conftest import prompt_query


def _decode_and_observe(model, policy, prompt_len=150, steps=40, pad=5):
    torch.manual_seed(0)
    ids = torch.randint(1, 128, (2, prompt_len))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    seen = []

    def observer(state, query):
        slots, valid = state.store.attended_slots()
        seen.append((state.layer_idx, state.store.length, slots.clone(), valid.clone(), state.store.pool.valid.clone()))

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
                  torch.randn(batch, heads, prompt, dim, generator=gen), valid, heads,
                  last_query=prompt_query(batch, heads, dim))
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
    assert store.sink.valid[:, 0].tolist() == [[True] * 4, [True, True, True, False]]


def test_a_budget_past_the_context_allocates_only_what_can_be_retrieved():
    # issue: --budget 100000 on a 42-token prompt allocated every layer's buffers at the full
    # budget (2.56 GB); the retrieved tier now holds at most the retrievable tokens outside the
    # local window (the sink's are its own), grown by the step's plan as tokens leave it
    from kvpolicy.layer import PolicyLayerState
    import kvpolicy

    gen = torch.Generator().manual_seed(1)
    batch, heads, dim, prompt, local = 1, 2, 8, 42, 16
    policy = kvpolicy.preset("quest", budget=100_000, local=local, backend="reference")
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    state.prefill(torch.randn(batch, heads, prompt, dim, generator=gen),
                  torch.randn(batch, heads, prompt, dim, generator=gen), torch.ones(batch, prompt, dtype=torch.bool), heads,
                  last_query=prompt_query(batch, heads, dim))
    store = state.store
    assert store.retrieval_limit == 100_000 - 4 - local
    assert store.retrieval_capacity == prompt - local - 4
    for step in range(60):
        state.decode(torch.randn(batch, heads, dim, generator=gen), torch.randn(batch, heads, dim, generator=gen),
                     torch.randn(batch, heads, dim, generator=gen), dim ** -0.5)
        assert store.retrieval_capacity == store.length - local - 4
        assert store.device_bytes() == store.full_bytes()  # every token attended, each held once
    # every token is attended: the buffer grew with the sequence and nothing was dropped
    slots, attended = store.attended_slots()
    assert set(slots[0, 0][attended[0, 0]].tolist()) == set(range(prompt + 60))


def _short_prompt_layer(name, prompt, budget, pad, seed=0, **options):
    from kvpolicy.layer import PolicyLayerState

    gen = torch.Generator().manual_seed(seed)
    batch, heads, dim = 2, 2, 8
    policy = kvpolicy.preset(name, budget=budget, backend="reference", **options)
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    valid = torch.ones(batch, prompt, dtype=torch.bool)
    valid[1, :pad] = False  # left padding
    state.prefill(torch.randn(batch, heads, prompt, dim, generator=gen),
                  torch.randn(batch, heads, prompt, dim, generator=gen), valid, heads,
                  last_query=prompt_query(batch, heads, dim))
    return state, gen, dim


@pytest.mark.parametrize("prompt", [2, 6, 17, 18, 40])
@pytest.mark.parametrize("name", ["streaming", "quest", "louiskv", "pariskv"])
def test_the_attended_buffer_never_holds_more_than_the_full_kv(name, prompt):
    # issue 15 (item 3): the sink and the ring were allocated whole on a short prompt, so
    # "KV on attention device" read 136% of the full KV for the README's command on a 43-token
    # prompt; each tier now has the rows the tokens so far can fill. Prompts shorter than the
    # sink, than the window, one and two past the window (sink rows filling), and longer
    local = 16
    budget = 4 + local if name == "streaming" else 1000
    options = {} if name == "streaming" else {"local": local}
    state, gen, dim = _short_prompt_layer(name, prompt, budget, pad=min(3, prompt - 1), **options)
    store = state.store
    # ParisKV's update buffer lays out a row for every decode step, valid or not (a short prompt's
    # sink tokens, steps where no token left the ring): up to local - prompt + 4 rows more
    # (TieredStore.retrievable)
    slack = max(local - prompt, 0) + 4 if name == "pariskv" and prompt < local + 4 else 0
    row = store.full_bytes() // store.length
    assert store.device_bytes() <= store.full_bytes()
    for _ in range(30):
        q, k, v = (torch.randn(2, 2, dim, generator=gen) for _ in range(3))
        state.decode(q, k, v, dim ** -0.5)
        assert store.device_bytes() <= store.full_bytes() + slack * row, store.length
    # what was held is still what a budget past the context attends: every valid token once
    slots, attended = store.attended_slots()
    newest = store.length - 1
    for b in range(2):
        for h in range(2):
            seen = slots[b, h][attended[b, h]].tolist()
            assert len(seen) == len(set(seen))
            want = set(torch.nonzero(store.pool.valid[b, : store.length]).flatten().tolist())
            if name == "streaming":  # the sink (the prompt's first 4 valid tokens) and the window
                sink = set(sorted(t for t in want if t < prompt)[:4])
                want = sink | (want & set(range(newest - local + 1, newest + 1)))
            assert set(seen) == want, (b, h)


# -- which stores attend a GPU pool by slot (store.ATTEND_POOL_BY_SLOT) ----------------------------------


@pytest.mark.parametrize("setting,every_step,expected", [
    ("every_step", True, True), ("every_step", False, False), (True, False, True), (False, True, False)])
def test_attending_the_pool_by_slot_follows_the_setting(monkeypatch, setting, every_step, expected):
    from kvpolicy import store

    monkeypatch.setattr(store, "ATTEND_POOL_BY_SLOT", setting)
    assert store.attends_pool_by_slot(every_step) is expected


def test_an_unknown_attend_setting_is_a_clear_error(monkeypatch):
    from kvpolicy import store

    monkeypatch.setattr(store, "ATTEND_POOL_BY_SLOT", "sometimes")
    with pytest.raises(ValueError, match=r"ATTEND_POOL_BY_SLOT must be one of \('every_step', True, False\); "
                                         r"got 'sometimes'"):
        store.attends_pool_by_slot(True)


@pytest.mark.parametrize("name,every_step", [("clusterkv", True), ("quest", True), ("louiskv", False)])
def test_a_layer_tells_its_store_whether_its_policy_reselects_every_step(monkeypatch, name, every_step):
    # every-step policies attend a GPU pool by slot (a re-selection moves no row); a policy that keeps its
    # selection copies the rows at a re-selection and reads them densely on the steps between
    from kvpolicy import store
    from kvpolicy.layer import PolicyLayerState

    seen = []

    def recording(reselects_every_step):  # what from_prefill asks the setting, answered by slot
        seen.append(reselects_every_step)
        return True

    monkeypatch.setattr(store, "attends_pool_by_slot", recording)
    gen = torch.Generator().manual_seed(2)
    state = PolicyLayerState(kvpolicy.preset(name, budget=40, local=8, backend="reference"), 0, torch.device("cpu"))
    state.prefill(torch.randn(1, 2, 96, 8, generator=gen), torch.randn(1, 2, 96, 8, generator=gen),
                  torch.ones(1, 96, dtype=torch.bool), 2, last_query=prompt_query(1, 2, 8))
    assert seen == [every_step]
    assert not state.store.attend_pool  # asked, but a CPU store never attends by slot
