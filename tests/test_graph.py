"""DecodeGraph's capture-and-replay protocol, emulated on the CPU, against eager generate.

On a CPU there is no CUDA graph; ``emulate=True`` re-runs the captured step with the host state
frozen at capture time, which is what a replay does. Tokens must equal eager decoding with the
same policy (on a GPU the same test runs the real graph). Emulated replays run under
``no_host_reads``: a step that read a device value on the host would be frozen by a real replay.
"""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy.errors import KVPolicyError
from kvpolicy.graph import DecodeGraph, greedy_decode
from kvpolicy.integrations.transformers import cache_argument_name

from conftest import build_model, left_padded_batch
from host_reads import no_host_reads

NEW_TOKENS = 24
CUDA = torch.cuda.is_available()


def _eager(model, policy, ids, mask):
    with policy.apply(model):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, ids.shape[1]:]


@pytest.fixture
def replays_read_nothing(monkeypatch):
    """Emulated replays (the whole model's step, not only the policy's) run under ``no_host_reads``."""
    real_replay = DecodeGraph._replay

    def guarded(self):
        if not self.emulate:
            return real_replay(self)
        with no_host_reads("an emulated graph replay"):
            return real_replay(self)

    monkeypatch.setattr(DecodeGraph, "_replay", guarded)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("name,budget", [("louiskv", 96), ("quest", 96), ("clusterkv", 512), ("streaming", 40), ("pariskv", 96)])
def test_replayed_decode_matches_eager(family, name, budget, single_thread, replays_read_nothing):
    device = torch.device("cuda" if CUDA else "cpu")
    model = build_model(family).to(device)
    ids, mask = left_padded_batch(200)
    ids, mask = ids.to(device), mask.to(device)
    options = {"budget": budget} if name != "streaming" else {"budget": budget, "sink": 4}
    if name != "streaming":
        options.update(sink=4, local=16)
    policy = kvpolicy.preset(name, **options)
    want = _eager(model, policy, ids, mask)
    got = greedy_decode(model, policy, ids, mask, NEW_TOKENS, emulate=not CUDA)
    assert torch.equal(got, want), (got, want)


def test_host_counters_after_replays_match_an_eager_run(single_thread):
    model = build_model("llama")
    ids, mask = left_padded_batch(120)
    policy = kvpolicy.preset("louiskv", budget=64, sink=4, local=16)
    counters = []
    for emulate in (False, True):
        with policy.apply(model) as session:
            cache = session.new_cache()
            position_ids = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)
            out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        **{cache_argument_name(model): cache})
            token = out.logits[:, -1].argmax(-1)
            if emulate:
                runner = DecodeGraph(model, cache, mask.sum(-1), 10, emulate=True)
                for _ in range(10):
                    token = runner.step(token).argmax(-1)
            else:
                full_mask = mask
                for step in range(10):
                    full_mask = torch.cat([full_mask, full_mask.new_ones(full_mask.shape[0], 1)], dim=1)
                    out = model(input_ids=token.view(-1, 1), attention_mask=full_mask, use_cache=True,
                                position_ids=(mask.sum(-1) + step).view(-1, 1), **{cache_argument_name(model): cache})
                    token = out.logits[:, -1].argmax(-1)
            counters.append([s.plan.counters() for s in cache.policy_layers()])
            assert counters[-1][0]["decode_steps"] == 10
    assert counters[0] == counters[1]


def test_refuses_misuse():
    model = build_model("llama")
    ids, mask = left_padded_batch(60)
    policy = kvpolicy.preset("quest", budget=48, sink=4, local=16)
    with policy.apply(model) as session:
        cache = session.new_cache()
        with pytest.raises(KVPolicyError, match="needs a prefilled cache"):
            DecodeGraph(model, cache, mask.sum(-1), 4, emulate=True)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{cache_argument_name(model): cache})
        if not CUDA:
            with pytest.raises(KVPolicyError, match="CUDA graphs need a CUDA device"):
                DecodeGraph(model, cache, mask.sum(-1), 4)
        runner = DecodeGraph(model, cache, mask.sum(-1), 1, emulate=True)
        runner.step(ids[:, -1])
        with pytest.raises(KVPolicyError, match="all reserved steps are used"):
            runner.step(ids[:, -1])
