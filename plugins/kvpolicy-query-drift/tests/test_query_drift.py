"""Tests for the query_drift trigger plugin.

The trigger's own tests run from a source checkout too; the entry-point test needs the
package installed (``pip install -e plugins/kvpolicy-query-drift``) and skips otherwise.
"""

from __future__ import annotations

import math
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

import kvpolicy
from kvpolicy.triggers import QueryCosine

try:
    import kvpolicy_query_drift
except ImportError:  # not installed: use the source next to this file
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import kvpolicy_query_drift

from kvpolicy_query_drift import QueryDrift, QueryDriftState

DIST = "kvpolicy-query-drift"
HEADS, DIM = 4, 8


def _installed() -> bool:
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    return True


def _planes(batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (sequence, head), two orthonormal directions u, v spanning the plane a query turns in."""
    g = torch.Generator().manual_seed(seed)
    basis, _ = torch.linalg.qr(torch.randn(batch, HEADS, DIM, 2, generator=g))
    return basis[..., 0], basis[..., 1]


def _turned(u: torch.Tensor, v: torch.Tensor, degrees) -> torch.Tensor:
    """Queries at ``degrees`` (a number, or one per sequence) from u towards v, each head at its
    own length (cosines ignore length): cos(query at a, query at b) = cos(a - b) exactly."""
    angle = torch.as_tensor(degrees, dtype=torch.float32).reshape(-1, 1, 1) * (math.pi / 180)
    lengths = torch.linspace(0.5, 3.0, HEADS).reshape(1, HEADS, 1)
    return lengths * (torch.cos(angle) * u + torch.sin(angle) * v)


def _run(trigger, queries: list[torch.Tensor]) -> list[list[bool]]:
    state = trigger.init_state(queries[0].shape[0], HEADS, DIM, queries[0].device)
    decisions = []
    for q in queries:
        fire = trigger.decide(q, state)
        assert fire.shape == (q.shape[0],) and fire.dtype == torch.bool and fire.device == q.device
        decisions.append(fire.tolist())
    return decisions


# ---------------------------------------------------------------- (a) decide() on hand-made queries


def test_fires_on_first_step_and_sets_the_anchor():
    u, v = _planes(2)
    trigger = QueryDrift(tau=0.7)
    state = trigger.init_state(2, HEADS, DIM, torch.device("cpu"))
    assert isinstance(state, QueryDriftState)
    q = _turned(u, v, 0.0)
    assert trigger.decide(q, state).tolist() == [True, True]
    torch.testing.assert_close(state.anchor, q)
    assert state.has_anchor.all()


def test_quiet_while_queries_stay_close_to_the_anchor():
    u, v = _planes(1)
    # wobble within +-20 degrees of the anchor: cos >= 0.94 > tau
    wobble = [0, 10, -15, 20, 5, -20, 12, 0]
    fired = _run(QueryDrift(tau=0.7), [_turned(u, v, a) for a in wobble])
    assert fired == [[True]] + [[False]] * (len(wobble) - 1)


def test_slow_drift_fires_where_query_cosine_does_not():
    """10 degrees a step: every consecutive cosine is cos(10 deg) = 0.985 > tau = 0.7, but the
    distance from the anchor adds up and passes tau (cos(50 deg) = 0.64) at step 5, then again
    5 steps after the anchor moved there."""
    u, v = _planes(1)
    queries = [_turned(u, v, 10.0 * step) for step in range(12)]

    drift = _run(QueryDrift(tau=0.7), queries)
    expected = [step in (0, 5, 10) for step in range(12)]
    assert [d[0] for d in drift] == expected

    consecutive = _run(QueryCosine(tau=0.7), queries)
    assert [d[0] for d in consecutive] == [True] + [False] * 11  # only its (first-step) default fire


def test_sequences_are_independent():
    """Row 0 drifts 10 degrees a step, row 1 holds still: only row 0 fires after the first step,
    and moving row 0's anchor leaves row 1's alone."""
    u, v = _planes(2)
    trigger = QueryDrift(tau=0.7)
    state = trigger.init_state(2, HEADS, DIM, torch.device("cpu"))
    decisions = []
    for step in range(12):
        q = _turned(u, v, [10.0 * step, 0.0])
        decisions.append(trigger.decide(q, state).tolist())
    assert [d[0] for d in decisions] == [step in (0, 5, 10) for step in range(12)]
    assert [d[1] for d in decisions] == [True] + [False] * 11
    torch.testing.assert_close(state.anchor[0], _turned(u, v, [100.0, 0.0])[0])
    torch.testing.assert_close(state.anchor[1], _turned(u, v, [0.0, 0.0])[1])


def test_half_precision_queries_keep_float32_state():
    u, v = _planes(2)
    trigger = QueryDrift(tau=0.7)
    state = trigger.init_state(2, HEADS, DIM, torch.device("cpu"))
    fire = trigger.decide(_turned(u, v, 0.0).to(torch.bfloat16), state)
    assert fire.tolist() == [True, True]
    assert state.anchor.dtype == torch.float32


def test_without_max_age_it_decides_as_the_builtin_anchor_trigger():
    """The anchor comparison is the built-in ``query_cosine(against="anchor")``'s, decision for
    decision: the plugin adds ``max_age``, not a second implementation."""
    g = torch.Generator().manual_seed(3)
    queries = [torch.randn(3, HEADS, DIM, generator=g) for _ in range(16)]
    for tau in (-0.2, 0.0, 0.3):
        assert _run(QueryDrift(tau=tau), queries) == _run(QueryCosine(tau=tau, against="anchor"), queries)


def test_max_age_bounds_how_long_a_selection_is_kept():
    """A query that holds still never moves the anchor: only the age re-selects, every max_age steps."""
    u, v = _planes(1)
    fired = _run(QueryDrift(tau=0.7, max_age=4), [_turned(u, v, 0.0)] * 12)
    assert [f[0] for f in fired] == [step % 4 == 0 for step in range(12)]


def test_an_old_selection_moves_the_anchor_to_the_query_it_is_made_for():
    """10 degrees a step with max_age 3: the age fires at steps 3, 6 and 9 and the anchor follows,
    so the drift never adds up to the 50 degrees that would fire on its own."""
    u, v = _planes(2)
    trigger = QueryDrift(tau=0.7, max_age=3)
    state = trigger.init_state(2, HEADS, DIM, torch.device("cpu"))
    decisions = [trigger.decide(_turned(u, v, [10.0 * step, 0.0]), state).tolist() for step in range(11)]
    assert [d[0] for d in decisions] == [step % 3 == 0 for step in range(11)]
    assert [d[1] for d in decisions] == [step % 3 == 0 for step in range(11)]
    torch.testing.assert_close(state.anchor[0], _turned(u, v, [90.0, 0.0])[0])
    assert state.age.tolist() == [1, 1]


@pytest.mark.parametrize("max_age", [0, -3, 2.5, True, "4"])
def test_bad_max_age_raises_config_error(max_age):
    with pytest.raises(kvpolicy.ConfigError, match=r"max_age must be an integer >= 1"):
        QueryDrift(max_age=max_age).validate()


# ---------------------------------------------------------------- (b) validate


@pytest.mark.parametrize("tau", [1.5, -1.01, float("nan"), "0.7"])
def test_bad_tau_raises_config_error(tau):
    with pytest.raises(kvpolicy.ConfigError, match=r"tau.*\[-1, 1\]"):
        QueryDrift(tau=tau).validate()


def test_bad_tau_is_caught_when_the_policy_is_built():
    with pytest.raises(kvpolicy.ConfigError, match=r"query_drift.*tau.*\[-1, 1\].*1\.5"):
        kvpolicy.Policy(trigger=QueryDrift(tau=1.5), prefill_units="kmeans", decode_units="segments",
                        selector="top_budget", budget=1024)


@pytest.mark.parametrize("tau", [-1.0, 0.0, 0.7, 1.0])
def test_good_tau_validates(tau):
    assert QueryDrift(tau=tau).validate() is None
    # a policy builds around it and keeps the value
    policy = kvpolicy.Policy(trigger=QueryDrift(tau=tau), prefill_units="kmeans", decode_units="segments",
                             selector="top_budget", budget=1024)
    assert policy.trigger.tau == tau
    # and it is the threshold decide uses: a query 120 degrees from the anchor (cos -0.5) fires
    # exactly when tau > -0.5
    u, v = _planes(1)
    fired = _run(policy.trigger, [_turned(u, v, 0.0), _turned(u, v, 120.0)])
    assert fired == [[True], [tau > -0.5]]


# ---------------------------------------------------------------- (c) entry-point discovery


@pytest.mark.skipif(not _installed(), reason=f"{DIST} is not installed; run `pip install -e plugins/kvpolicy-query-drift`")
def test_entry_point_is_discovered():
    eps = metadata.entry_points(group="kvpolicy.plugins")
    assert any(ep.name == "query_drift" and ep.value == "kvpolicy_query_drift" for ep in eps)
    assert "query_drift" in kvpolicy.registry.names("trigger")
    assert kvpolicy.registry.lookup("trigger", "query_drift") is QueryDrift
    # in a fresh interpreter nothing has imported the plugin, so only discovery can register it
    code = (
        "import sys, kvpolicy\n"
        "assert 'kvpolicy_query_drift' not in sys.modules\n"
        "print('query_drift' in kvpolicy.registry.names('trigger'))\n"
        "policy = kvpolicy.Policy.from_dict({'preset': 'louiskv', 'trigger': {'name': 'query_drift', 'tau': 0.8}})\n"
        "print(type(policy.trigger).__module__, policy.trigger.tau)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "kvpolicy_query_drift", "0.8"]


# ---------------------------------------------------------------- (d) end to end


def test_generate_matches_dense_when_the_budget_covers_everything():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    model = LlamaForCausalLM(config).eval()
    batch, prompt = 2, 300
    input_ids = torch.randint(1, 128, (batch, prompt))
    attention_mask = torch.ones(batch, prompt, dtype=torch.long)
    attention_mask[1, :7] = 0  # left padding on one row
    input_ids[1, :7] = 0
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=16, do_sample=False,
                  output_scores=True, return_dict_in_generate=True, pad_token_id=0)

    with torch.no_grad():
        reference = model.generate(**kwargs)
        policy = kvpolicy.Policy(trigger="query_drift", prefill_units="kmeans", decode_units="segments",
                                 selector="top_budget", budget=1024)
        assert isinstance(policy.trigger, QueryDrift)
        with policy.apply(model) as session:
            out = model.generate(**kwargs)

    assert len(out.scores) == len(reference.scores) == 16
    for step, (got, want) in enumerate(zip(out.scores, reference.scores)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4, msg=lambda m: f"decode step {step}: {m}")
    assert torch.equal(out.sequences, reference.sequences)
    # the policy path really ran, with this trigger's state in every served layer
    layers = session.cache.policy_layers()
    assert len(layers) == 2
    for layer in layers:
        assert isinstance(layer.trigger_state, QueryDriftState)
        assert layer.trigger_state.has_anchor.all()
        assert layer.reselections.min() >= 1  # at least the first step
    assert session.stats().decode_steps > 0
    assert model.config._attn_implementation != "kvpolicy"  # restored on exit
