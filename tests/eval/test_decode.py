"""The eval's decode through DecodeGraph (emulated on CPU) gives what the eager loop gives."""

from __future__ import annotations

import functools

import pytest
import torch

import kvpolicy
from kvpolicy.eval import decode as decoding

from conftest import build_model


@pytest.fixture(scope="module")
def shared():
    model = build_model("llama", max_position_embeddings=2048)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(5))
    return model, decoding.prefill(model, ids, torch.ones_like(ids))


@pytest.mark.parametrize("name", ["louiskv", "quest", "clusterkv", "pariskv"])
def test_graph_decode_matches_eager(shared, name, single_thread):
    model, prefilled = shared
    policy = kvpolicy.preset(name, budget=96, sink=4, local=16)
    eager = decoding.decode(model, prefilled, policy, 20, measure_recall=True, keep_logits=True, graph=False)
    replay = decoding.decode(model, prefilled, policy, 20, measure_recall=True, keep_logits=True, graph="emulate")
    assert replay.tokens == eager.tokens
    assert replay.reselect_share == pytest.approx(eager.reselect_share)
    assert replay.recall_per_layer == pytest.approx(eager.recall_per_layer, abs=1e-6)
    assert len(replay.logits) == len(eager.logits) == 20
    for a, b in zip(replay.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert 0.0 < eager.recall < 1.0  # a budget under the context really loses some mass


def test_graph_decode_teacher_forced_and_stopped(shared, single_thread):
    model, prefilled = shared
    policy = kvpolicy.preset("louiskv", budget=96, sink=4, local=16)
    forced = list(range(10, 26))
    eager = decoding.decode(model, prefilled, policy, 16, forced=forced, keep_logits=True, graph=False)
    replay = decoding.decode(model, prefilled, policy, 16, forced=forced, keep_logits=True, graph="emulate")
    assert replay.tokens == eager.tokens == forced
    for a, b in zip(replay.logits, eager.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    free = decoding.decode(model, prefilled, policy, 16, graph=False)
    stop = {free.tokens[5]}
    first = free.tokens.index(free.tokens[5])
    stopped_eager = decoding.decode(model, prefilled, policy, 16, stop_ids=stop, graph=False)
    stopped_replay = decoding.decode(model, prefilled, policy, 16, stop_ids=stop, graph="emulate")
    assert stopped_replay.tokens == stopped_eager.tokens == free.tokens[: first + 1]


def test_the_eval_prefill_projects_only_the_last_position_to_the_vocabulary():
    # full-vocabulary logits of every prompt position cost 1 MB a token on Gemma 3 (a 16K CPU eval
    # was killed for memory); the prefill asks for the last position's alone, with the same values
    model = build_model("llama", max_position_embeddings=512)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(2))
    seen = []
    forward = model.forward

    @functools.wraps(forward)  # keeps the signature the prefill reads
    def spy(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append((kwargs.get("logits_to_keep"), tuple(out.logits.shape)))
        return out

    model.forward = spy
    prefilled = decoding.prefill(model, ids, torch.ones_like(ids))
    assert seen == [(1, (1, 1, model.config.vocab_size))]
    with torch.inference_mode():
        whole = forward(input_ids=ids).logits[:, -1].float()
    torch.testing.assert_close(prefilled.last_logits, whole, rtol=1e-5, atol=1e-5)
