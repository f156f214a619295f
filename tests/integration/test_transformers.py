"""The transformers integration: sampling, batching with padding at a small budget, run
statistics, restoring the model, hybrid (sliding + full attention) models, and the models
kvpolicy refuses to serve.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.cache_utils import DynamicLayer

import kvpolicy
from kvpolicy.integrations.transformers import PolicyCache, PolicyCacheLayer, cache_argument_name

from conftest import TINY, build_from_config, build_model, left_padded_batch
from reuse_check import checking_reuse

pytestmark = pytest.mark.usefixtures("single_thread")

RETRIEVAL_PRESETS = [name for name in kvpolicy.PRESETS if not kvpolicy.preset(name).is_dense]
# presets whose trigger keeps the selection between re-selections at the small budget below
REUSE_VARIANTS = {
    "louiskv-interval": ("louiskv", {"trigger": {"name": "interval", "n": 4}}),
    "louiskv-keep": ("louiskv", {"trigger": {"name": "query_cosine", "tau": -1.0}, "first_selection": "first_step"}),
    "clusterkv-interval": ("clusterkv", {"trigger": {"name": "interval", "n": 5}}),
    "pariskv-interval": ("pariskv", {"trigger": {"name": "interval", "n": 3}}),
}


def small_budget_policy(name: str, budget: int) -> kvpolicy.Policy:
    name, options = REUSE_VARIANTS.get(name, (name, {}))
    return kvpolicy.preset(name, budget=budget, **options)


def greedy(model, ids, mask, new_tokens):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                          output_scores=True, return_dict_in_generate=True)


def max_difference(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def llama():
    return build_model("llama")


# --- sampling ------------------------------------------------------------------------------


@pytest.mark.parametrize("preset_name", ["louiskv", "quest"])
def test_sampled_generate_matches_plain_at_full_budget(llama, preset_name):
    ids, mask = left_padded_batch(200)
    options = dict(attention_mask=mask, max_new_tokens=32, do_sample=True, temperature=1.0, top_k=0)
    torch.manual_seed(1234)
    plain = llama.generate(ids, **options)
    with kvpolicy.preset(preset_name, budget=512).apply(llama) as session:
        torch.manual_seed(1234)
        sampled = llama.generate(ids, **options)
    assert session.stats().decode_steps == 31
    assert torch.equal(sampled, plain)


# --- batch with left padding at a small budget ----------------------------------------------


@pytest.mark.parametrize("preset_name", RETRIEVAL_PRESETS + list(REUSE_VARIANTS))
def test_left_padded_batch_small_budget(llama, preset_name):
    prompt, budget, new_tokens = 300, 96, 32
    ids, mask = left_padded_batch(prompt)
    policy = small_budget_policy(preset_name, budget)
    with policy.apply(llama) as session, checking_reuse() as reuse:
        out = greedy(llama, ids, mask, new_tokens)
    assert out.sequences.shape == (2, prompt + new_tokens)
    assert len(out.scores) == new_tokens
    assert all(torch.isfinite(step).all() for step in out.scores)

    stats = session.stats()
    assert stats.budget == budget
    assert stats.context_tokens == prompt
    assert stats.decode_steps == new_tokens - 1
    assert stats.served_layers == llama.config.num_hidden_layers
    if stats.reselect_share is not None:
        assert 0.0 <= stats.reselect_share <= 1.0
    if policy.selector is not None and (policy.trigger.always_reselects or policy.first_selection == "first_step"):
        assert stats.reselect_share > 0  # the first decode step always selects
    if preset_name in REUSE_VARIANTS:
        # the selection was kept on most steps, and each such step attended the previous
        # selection exactly, reading nothing from the pool (checked by checking_reuse; the
        # selection fills the buffer here, so nothing is admitted: the dense matrix admits)
        assert stats.reselect_share < 0.5
        assert reuse.reusing > 0, reuse
    elif policy.selector is not None and policy.trigger.always_reselects:
        assert stats.reselect_share == 1.0 and reuse.reusing == 0
    assert 0 < stats.device_kv_bytes < stats.full_kv_bytes
    # the full KV: (B, H, tokens, D) keys and values of every layer, float32
    config = llama.config
    tokens = prompt + new_tokens - 1
    assert stats.full_kv_bytes == config.num_hidden_layers * 2 * 2 * config.num_key_value_heads * tokens * config.head_dim * 4
    assert set(stats.as_dict()) >= {"reselect_share", "device_kv_bytes", "full_kv_bytes"}


def test_small_budget_changes_the_output(llama):
    """At a budget far below the context the policy is really in the loop (not dense by accident)."""
    ids, mask = left_padded_batch(300)
    plain = greedy(llama, ids, mask, 8)
    with kvpolicy.preset("streaming", budget=16).apply(llama):
        windowed = greedy(llama, ids, mask, 8)
    assert max_difference(windowed.scores, plain.scores) > 1e-3


def test_dense_preset_stats(llama):
    ids, mask = left_padded_batch(100)
    with kvpolicy.preset("full").apply(llama) as session:
        greedy(llama, ids, mask, 8)
    stats = session.stats()
    assert (stats.context_tokens, stats.decode_steps, stats.reselect_share) == (100, 7, None)
    assert stats.device_kv_bytes == stats.full_kv_bytes > 0


# --- the model is restored -------------------------------------------------------------------


def _attention_implementations(model) -> set[str]:
    return {m.config._attn_implementation for m in model.modules() if getattr(m, "config", None) is not None}


def test_model_restored_after_the_block(llama):
    before = llama.config._attn_implementation
    with kvpolicy.preset("quest", budget=128).apply(llama):
        assert llama.config._attn_implementation == "kvpolicy"
        assert "generate" in llama.__dict__
    assert llama.config._attn_implementation == before
    assert _attention_implementations(llama) == {before}
    assert "generate" not in llama.__dict__
    assert llama.generate.__func__ is type(llama).generate


def test_model_restored_when_the_block_raises(llama):
    before = llama.config._attn_implementation
    ids, mask = left_padded_batch(100)
    with pytest.raises(RuntimeError, match="boom"):
        with kvpolicy.preset("louiskv", budget=128).apply(llama):
            greedy(llama, ids, mask, 2)
            raise RuntimeError("boom")
    assert llama.config._attn_implementation == before
    assert _attention_implementations(llama) == {before}
    assert "generate" not in llama.__dict__
    # and the model still decodes as before
    plain = greedy(llama, ids, mask, 4)
    assert all(torch.isfinite(step).all() for step in plain.scores)


def test_nested_sessions_restore_the_outer_one(llama):
    ids, mask = left_padded_batch(100)
    with kvpolicy.preset("quest", budget=128).apply(llama) as outer:
        outer_generate = llama.__dict__["generate"]
        with kvpolicy.preset("full").apply(llama):
            pass
        assert llama.__dict__["generate"] is outer_generate
        greedy(llama, ids, mask, 2)
        assert isinstance(outer.cache, PolicyCache)
    assert "generate" not in llama.__dict__


def test_cache_is_freed_with_the_session(llama):
    """Nothing kvpolicy keeps (thread-locals, the model) holds a finished session's KV pool."""
    import gc
    import weakref

    ids, mask = left_padded_batch(100)
    with kvpolicy.preset("quest", budget=128).apply(llama) as session:
        out = greedy(llama, ids, mask, 4)
    cache = weakref.ref(session.cache)
    del session, out
    gc.collect()
    assert cache() is None


def test_forward_without_cache_inside_the_block_is_dense(llama):
    ids, mask = left_padded_batch(64)
    plain = llama(input_ids=ids, attention_mask=mask, use_cache=False).logits
    with kvpolicy.preset("quest", budget=128).apply(llama):
        served = llama(input_ids=ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    assert (served[real] - plain[real]).abs().max().item() <= 1e-5


def test_cache_argument_name_matches_the_installed_transformers(llama):
    import inspect

    name = cache_argument_name(llama)
    assert name in inspect.signature(llama.forward).parameters
    assert name in ("cache", "past_key_values")


# --- hybrid models: sliding-window layers keep transformers' cache ---------------------------


def hybrid_qwen2():
    # layer 0 full attention, layer 1 a 32-token sliding window
    return build_model("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=1)


def hybrid_gemma3():
    config = transformers.Gemma3TextConfig(
        **{**TINY, "sliding_window": 32, "layer_types": ["sliding_attention", "full_attention"],
           "final_logit_softcapping": None}
    )
    return build_from_config(config, transformers.Gemma3ForCausalLM)


@pytest.mark.parametrize("preset_name", ["louiskv", "quest", "streaming"])
@pytest.mark.parametrize("build, full_layers", [(hybrid_qwen2, [0]), (hybrid_gemma3, [1])], ids=["qwen2", "gemma3"])
def test_hybrid_model(build, full_layers, preset_name):
    model = build()
    assert [t == "full_attention" for t in model.config.layer_types] == [i in full_layers for i in range(2)]
    ids, mask = left_padded_batch(300)  # far beyond the 32-token window
    plain = greedy(model, ids, mask, 32)
    with kvpolicy.preset(preset_name, budget=512).apply(model) as session:
        served = greedy(model, ids, mask, 32)
    cache = session.cache
    assert cache.served == full_layers
    for idx, layer in enumerate(cache.layers):
        if idx in full_layers:
            assert isinstance(layer, PolicyCacheLayer)
            assert layer.state.decode_steps == 31
        else:
            assert not isinstance(layer, PolicyCacheLayer)
            assert isinstance(layer, DynamicLayer) and layer.is_sliding
            assert type(layer).__module__ == "transformers.cache_utils"
    stats = session.stats()
    assert stats.served_layers == len(full_layers)
    # the sliding layers' own KV counts on both sides of the figure
    sliding = sum(2 * l.keys.numel() * l.keys.element_size() for i, l in enumerate(cache.layers) if i not in full_layers)
    assert sliding > 0
    assert stats.full_kv_bytes == sliding + sum(cache.layers[i].state.store.full_bytes() for i in full_layers)
    assert stats.device_kv_bytes == sliding + sum(cache.layers[i].state.store.device_bytes() for i in full_layers)
    assert max_difference(served.scores, plain.scores) <= 1e-4
    assert torch.equal(served.sequences, plain.sequences)


# --- models kvpolicy refuses -----------------------------------------------------------------


def _refuses(model, match: str, preset_name: str = "quest") -> None:
    before = model.config._attn_implementation
    with pytest.raises(kvpolicy.UnsupportedModelError, match=match):
        with kvpolicy.preset(preset_name, budget=256).apply(model):
            pytest.fail("the block must not run")
    # a refusal leaves the model untouched
    assert model.config._attn_implementation == before
    assert "generate" not in model.__dict__


@pytest.mark.parametrize("preset_name", RETRIEVAL_PRESETS)
def test_all_sliding_mistral_is_refused(preset_name):
    _refuses(build_model("mistral", sliding_window=32), "no full-attention layers", preset_name)


def test_all_sliding_layer_types_are_refused():
    model = build_model("qwen2", use_sliding_window=True, sliding_window=32,
                        layer_types=["sliding_attention", "sliding_attention"])
    _refuses(model, "no full-attention layers")


def test_attention_softcapping_is_refused():
    # its attention is not plain softmax: the policy's decode would be silently wrong
    config = transformers.Gemma2Config(**{**TINY, "sliding_window": 32, "attn_logit_softcapping": 50.0})
    config._attn_implementation = "eager"  # transformers 5.24 has no SDPA for Gemma2
    torch.manual_seed(0)
    model = transformers.Gemma2ForCausalLM(config).eval()
    _refuses(model, "attn_logit_softcapping|SDPA")


def tiny_t5():
    config = transformers.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                   num_heads=4, decoder_start_token_id=0, pad_token_id=0)
    return build_from_config(config, transformers.T5ForConditionalGeneration)


def tiny_bart():
    config = transformers.BartConfig(vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2,
                                     encoder_attention_heads=4, decoder_attention_heads=4,
                                     encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=1024)
    return build_from_config(config, transformers.BartForConditionalGeneration)


@pytest.mark.parametrize("preset_name", ["full", "quest"])
@pytest.mark.parametrize("build", [tiny_t5, tiny_bart], ids=["t5", "bart"])
def test_encoder_decoder_is_refused(build, preset_name):
    model = build()
    policy = kvpolicy.preset(preset_name, **({} if preset_name == "full" else {"budget": 256}))
    with pytest.raises(kvpolicy.UnsupportedModelError, match="encoder-decoder"):
        with policy.apply(model):
            pytest.fail("the block must not run")


# --- caches the user passes: refused in words, never a silent dense run ----------------------


def test_a_dense_cache_passed_to_generate_is_refused(llama):
    from transformers import DynamicCache

    from kvpolicy.errors import KVPolicyError

    ids, mask = left_padded_batch(40)
    with kvpolicy.preset("quest", budget=128).apply(llama):
        with pytest.raises(KVPolicyError, match="DynamicCache inside policy.apply"):
            llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           **{cache_argument_name(llama): DynamicCache(config=llama.config)})


def test_generate_without_a_cache_is_refused(llama):
    from kvpolicy.errors import KVPolicyError

    ids, mask = left_padded_batch(40)
    with kvpolicy.preset("quest", budget=128).apply(llama):
        with pytest.raises(KVPolicyError, match="use_cache=False"):
            llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False, use_cache=False)


def test_a_second_turn_on_the_same_cache_is_refused_and_a_fresh_one_serves(llama):
    from kvpolicy.errors import KVPolicyError

    ids, mask = left_padded_batch(40)
    with kvpolicy.preset("quest", budget=128).apply(llama) as session:
        cache = session.new_cache()
        llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                       **{cache_argument_name(llama): cache})
        assert session.stats().decode_steps == 1  # the passed cache's generation is what stats reports
        with pytest.raises(KVPolicyError, match="second turn"):
            llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False,
                           **{cache_argument_name(llama): cache})


def test_stats_report_the_retrieval_index(llama):
    ids, mask = left_padded_batch(100)
    with kvpolicy.preset("quest", budget=96).apply(llama) as session:
        greedy(llama, ids, mask, 8)
    stats = session.stats()
    states = session.cache.policy_layers()
    table = states[0].units
    per_layer = sum(t.numel() * t.element_size() for t in vars(table).values() if isinstance(t, torch.Tensor))
    assert per_layer > 0 and stats.index_bytes == len(states) * per_layer
    with kvpolicy.preset("streaming").apply(llama) as session:
        greedy(llama, ids, mask, 4)
    assert session.stats().index_bytes == 0


def test_entering_one_session_twice_is_refused_and_the_model_restored(llama):
    from kvpolicy.errors import KVPolicyError

    before = _attention_implementations(llama)
    session = kvpolicy.preset("quest", budget=128).apply(llama)
    with session:
        with pytest.raises(KVPolicyError, match="already active"):
            with session:
                pass
    assert _attention_implementations(llama) == before
    with session:  # once left, it may be entered again
        pass
    assert _attention_implementations(llama) == before
