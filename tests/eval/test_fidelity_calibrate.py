"""Long-output fidelity and tau calibration on a tiny random model (the real runs are in EVAL.md)."""

import json

import pytest
import torch

import kvpolicy
from kvpolicy.calibration import calibrated_tau
from kvpolicy.errors import ConfigError
from kvpolicy.eval import decode as decoding
from kvpolicy.eval.calibrate import calibrate
from kvpolicy.eval.fidelity import measure

from conftest import build_model
from test_tasks import CHAT_TEMPLATE, _train_tokenizer


def _model(vocab: int):
    return build_model("llama", vocab_size=vocab, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def prefilled():
    model = _model(128)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(1))
    return model, decoding.prefill(model, ids, torch.ones_like(ids))


def test_full_budget_policies_have_perfect_fidelity(prefilled):
    model, shared = prefilled
    results = measure(model, shared, [kvpolicy.preset(n, budget=512) for n in ("louiskv", "quest")], new_tokens=24)
    for r in results:
        assert r.kl_mean < 1e-6
        assert r.top1_agreement == 1.0
        assert r.free_agreement == 1.0


def test_small_budget_loses_fidelity(prefilled):
    model, shared = prefilled
    (streaming,) = measure(model, shared, [kvpolicy.preset("streaming", budget=16)], new_tokens=24)
    assert streaming.kl_mean > 1e-4
    assert 0.0 <= streaming.top1_agreement <= 1.0 and 0.0 <= streaming.free_agreement <= 1.0


def test_calibrate_stores_a_tau_that_becomes_the_default(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOLICY_CACHE", str(tmp_path))
    tokenizer = _train_tokenizer(CHAT_TEMPLATE)
    model = _model(len(tokenizer))
    model.config._name_or_path = "tiny-calibration-model"
    taus = (0.5, 0.9)
    chosen, points = calibrate(model, tokenizer, taus=taus, samples=2, length=400, steps=6, budget=128, min_tokens=12)
    assert chosen in taus
    assert [p.tau for p in points] == list(taus)
    # on these prompts the more eager tau re-selects at least as often
    assert points[0].reselect_share <= points[1].reselect_share
    stored = json.loads((tmp_path / "calibration.json").read_text())
    assert stored["tiny-calibration-model"]["tau"] == chosen
    assert calibrated_tau(model) == chosen
    assert kvpolicy.preset("louiskv", model=model).trigger.tau == chosen


def test_calibrate_refuses_a_budget_covering_the_prompt():
    with pytest.raises(ConfigError, match="covers the whole"):
        calibrate(None, None, length=512, budget=512)
