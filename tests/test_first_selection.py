"""``first_selection="prompt"``: a policy that keeps its selection makes its first one at the end of
the prefill, from the prompt's last query, and its trigger decides from the first decode step on.

One layer driven directly, on keys with a planted needle per sequence, so what the selection must
hold is known; then the model paths that hand the prefill its last query (``generate`` and the
eval's shared dense prefill).
"""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import ConfigError, KVPolicyError
from kvpolicy.eval import decode as decoding
from kvpolicy.layer import PolicyLayerState

from conftest import build_model

pytestmark = pytest.mark.usefixtures("single_thread")

B, HQ, H, D = 2, 4, 2, 16
PROMPT, BUDGET, SINK, LOCAL = 300, 64, 4, 16
NEEDLES = ((101, 230), (180, 57))  # per sequence: two slots of the retrieval zone, one a needle each
NEEDLE = 20.0


def _layer(trigger, first_selection: str = "prompt", seed: int = 0):
    """A louiskv layer after the prompt; returns (state, directions (2, B, H, D), generator)."""
    gen = torch.Generator().manual_seed(seed)
    directions = torch.nn.functional.normalize(torch.randn(2, B, H, D, generator=gen), dim=-1)
    keys = torch.randn(B, H, PROMPT, D, generator=gen)
    for b in range(B):
        for needle, slot in enumerate(NEEDLES[b]):
            keys[b, :, slot] = NEEDLE * directions[needle, b]
    policy = kvpolicy.preset("louiskv", budget=BUDGET, sink=SINK, local=LOCAL, trigger=trigger,
                             first_selection=first_selection)
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    query = _query(directions[0], gen)
    state.prefill(keys, torch.randn(B, H, PROMPT, D, generator=gen), torch.ones(B, PROMPT, dtype=torch.bool), HQ,
                  last_query=query if first_selection == "prompt" else None)
    return state, directions, gen


def _query(direction: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return 3.0 * direction.repeat_interleave(HQ // H, dim=1) + 0.1 * torch.randn(B, HQ, D, generator=gen)


def _attended(state) -> list[list[set[int]]]:
    slots, valid = state.store.attended_slots()
    return [[set(slots[b, h][valid[b, h]].tolist()) for h in range(H)] for b in range(B)]


def _step(state, query: torch.Tensor, gen: torch.Generator) -> list[bool]:
    before = state.reselections.clone()
    state.decode(query, torch.randn(B, H, D, generator=gen), torch.randn(B, H, D, generator=gen), D**-0.5)
    return (state.reselections > before).tolist()


SCORE_GAP = {"name": "score_gap", "measure": "mass", "margin": 0.0}


def test_the_prompt_selection_holds_what_the_last_query_points_at_before_any_step():
    state, directions, gen = _layer(SCORE_GAP)
    attended = _attended(state)
    for b in range(B):
        for h in range(H):
            assert NEEDLES[b][0] in attended[b][h], f"seq {b}, head {h}: the last query's needle is not held"
    assert state.has_selection.all() and not state.reselect.any()
    assert state.decode_steps == 0 and int(state.reselections.sum()) == 0  # no decode step selected


def test_the_trigger_keeps_the_prompt_selection_while_the_query_stays_and_fires_when_it_moves():
    state, directions, gen = _layer(SCORE_GAP)
    assert _step(state, _query(directions[0], gen), gen) == [False] * B  # nothing forces the first step
    for b in range(B):
        for h in range(H):
            assert NEEDLES[b][0] in _attended(state)[b][h]
    assert _step(state, _query(directions[1], gen), gen) == [True] * B  # the other needle outscores the held units
    for b in range(B):
        for h in range(H):
            assert NEEDLES[b][1] in _attended(state)[b][h]


def test_first_step_selection_is_forced_as_before():
    state, directions, gen = _layer(SCORE_GAP, first_selection="first_step")
    assert not state.has_selection.any()
    assert _step(state, _query(directions[0], gen), gen) == [True] * B


def test_query_cosine_compares_the_first_step_with_the_prompts_query():
    state, directions, gen = _layer({"name": "query_cosine", "tau": 0.5})
    assert _step(state, _query(directions[0], gen), gen) == [False] * B
    assert _step(state, _query(-directions[0], gen), gen) == [True] * B


def test_interval_counts_from_the_prompts_selection():
    state, directions, gen = _layer({"name": "interval", "n": 3})
    fired = [_step(state, _query(directions[0], gen), gen)[0] for _ in range(7)]
    assert fired == [False, False, True, False, False, True, False]


def test_a_prefill_without_the_last_query_is_refused_in_words():
    policy = kvpolicy.preset("louiskv", budget=BUDGET, sink=SINK, local=LOCAL, first_selection="prompt")
    state = PolicyLayerState(policy, 3, torch.device("cpu"))
    keys = torch.randn(1, H, PROMPT, D)
    with pytest.raises(KVPolicyError, match=r"layer 3: first_selection='prompt'.*last_query of shape \(1, 4, 16\).*got none"):
        state.prefill(keys, keys, torch.ones(1, PROMPT, dtype=torch.bool), HQ)
    with pytest.raises(KVPolicyError, match=r"got \(1, 2, 16\)"):
        state.prefill(keys, keys, torch.ones(1, PROMPT, dtype=torch.bool), HQ, last_query=torch.randn(1, 2, D))


def test_an_unknown_first_selection_names_the_accepted_ones():
    with pytest.raises(ConfigError, match="unknown first_selection 'prefill'; accepted: first_step, prompt"):
        kvpolicy.Policy(first_selection="prefill")


def test_an_every_step_policy_ignores_it():
    policy = kvpolicy.preset("clusterkv", budget=BUDGET, sink=SINK, local=LOCAL, first_selection="prompt")
    state = PolicyLayerState(policy, 0, torch.device("cpu"))
    keys = torch.randn(1, H, PROMPT, D)
    state.prefill(keys, keys, torch.ones(1, PROMPT, dtype=torch.bool), HQ)  # no query needed
    assert not state.has_selection.any()


# --- through the model ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_prompt():
    model = build_model("llama", max_position_embeddings=1024)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(7))
    return model, ids


def test_the_eval_prefill_keeps_each_layers_last_query_as_generate_hands_it_over(model_and_prompt):
    model, ids = model_and_prompt
    prefilled = decoding.prefill(model, ids, torch.ones_like(ids))
    config = model.config
    assert sorted(prefilled.last_queries) == list(range(config.num_hidden_layers))
    policy = kvpolicy.preset("louiskv", budget=96, sink=4, local=16, first_selection="prompt")
    seen = {}
    original = PolicyLayerState.prefill

    def spy(self, *args, last_query=None, **kwargs):
        seen[self.layer_idx] = last_query.clone()
        return original(self, *args, last_query=last_query, **kwargs)

    PolicyLayerState.prefill = spy
    try:
        with policy.apply(model):
            generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    finally:
        PolicyLayerState.prefill = original
    for idx, query in prefilled.last_queries.items():
        assert query.shape == (1, config.num_attention_heads, config.hidden_size // config.num_attention_heads)
        torch.testing.assert_close(query, seen[idx], rtol=0, atol=1e-5)
    # and the eval's decode from the shared prefill gives generate's tokens
    decoded = decoding.decode(model, prefilled, policy, 12, graph=False)
    assert decoded.tokens == generated[0, ids.shape[1]:].tolist()
    assert model.config._attn_implementation == "sdpa"  # the recorder's attention is put back


def test_a_run_that_keeps_the_prompt_selection_reports_no_reselection(model_and_prompt):
    # the query_cosine trigger at its lowest tau never fires: the forced first step was the only
    # re-selection; with the prompt's selection there is none, and the answer is dense's at a whole budget
    model, ids = model_and_prompt
    keep = {"name": "query_cosine", "tau": -1.0}
    shares = {}
    for first in ("first_step", "prompt"):
        policy = kvpolicy.preset("louiskv", budget=512, trigger=keep, first_selection=first)
        with policy.apply(model) as session:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
            shares[first] = session.stats().reselect_share
        with kvpolicy.preset("full").apply(model):
            dense = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert out.tolist() == dense.tolist()
    # 8 new tokens are 7 decode steps: the last one is never fed back
    assert shares == {"first_step": pytest.approx(1 / 7), "prompt": 0.0}


def test_the_spec_and_the_description_name_it_where_it_applies():
    prompt = kvpolicy.preset("louiskv")
    first_step = kvpolicy.preset("louiskv", first_selection="first_step")
    assert prompt.first_selection == "prompt"  # the preset's default
    assert prompt.to_dict()["first_selection"] == "prompt"
    # at the old behaviour the spec keeps its old keys (the eval's cell keys hash them)
    assert "first_selection" not in first_step.to_dict()
    for policy in (prompt, first_step):
        assert kvpolicy.Policy.from_dict(policy.to_dict()) == policy
    assert "first_selection=prompt" in prompt.describe()
    assert "first_selection" not in kvpolicy.preset("quest").describe()  # it re-selects every step
