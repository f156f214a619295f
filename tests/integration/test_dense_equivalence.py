"""The anchor test: with a budget that covers the whole context, every preset reproduces
dense attention, on every supported family, through ``generate`` and through manual
prefill + single-token decode calls.

The prompt is long enough that the retrieval zone (beyond sink 4 + local 64) holds most of
it, and the batch is left-padded, so prefill unit building, selection, fetching, the local
ring's evictions and padding masks are all on the path being compared.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvpolicy
from kvpolicy.integrations.transformers import PolicyCache, cache_argument_name

from conftest import FAMILIES, build_model, left_padded_batch
from every_preset import EVERY_PRESET, VARIANTS
from reuse_check import checking_reuse

pytestmark = pytest.mark.usefixtures("single_thread")

PROMPT = 300
NEW_TOKENS = 64
BUDGET = 512  # >= PROMPT + NEW_TOKENS: nothing is ever left out
TOLERANCE = 1e-4


# variant -> re-selections after ``steps`` decode steps, per layer and sequence
REUSING = {"louiskv-keep": lambda steps: 1, "quest-interval": lambda steps: -(-steps // 8),
           "louiskv-keep-prompt": lambda steps: 0}
POLICIES = EVERY_PRESET


def make_policy(name: str) -> kvpolicy.Policy:
    name, options = VARIANTS.get(name, (name, {}))
    policy = kvpolicy.preset(name)
    # dense presets take no budget; every other preset gets one covering the whole context
    return policy if policy.is_dense else kvpolicy.preset(name, budget=BUDGET, **options)


def generate(model, input_ids, attention_mask):
    return model.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_scores=True,
        output_logits=True,
        return_dict_in_generate=True,
    )


def manual_decode(model, input_ids, attention_mask, cache):
    """Prefill, then ``NEW_TOKENS`` single-token steps feeding the argmax back, positions as
    generate computes them for left padding. Returns (prefill logits, (B, steps+1, V) logits, tokens)."""
    name = cache_argument_name(model)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                use_cache=True, **{name: cache})
    prefill = out.logits
    steps, tokens = [out.logits[:, -1]], []
    for _ in range(NEW_TOKENS):
        token = steps[-1].argmax(-1, keepdim=True)
        tokens.append(token)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(token.shape)], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        out = model(input_ids=token, attention_mask=attention_mask, position_ids=position_ids,
                    use_cache=True, **{name: cache})
        steps.append(out.logits[:, -1])
    return prefill, torch.stack(steps, dim=1), torch.cat(tokens, dim=-1)


@pytest.fixture(scope="module")
def reference():
    """Per family: the model, the prompt, and the plain model's generate and manual outputs."""
    built = {}

    def get(family):
        if family not in built:
            model = build_model(family)
            ids, mask = left_padded_batch(PROMPT)
            with torch.no_grad():
                generated = generate(model, ids, mask)
                manual = manual_decode(model, ids, mask, DynamicCache(config=model.config))
            built[family] = (model, ids, mask, generated, manual)
        return built[family]

    return get


def assert_close(actual, expected, what):
    error = (actual - expected).abs().max().item()
    assert error <= TOLERANCE, f"{what}: max |difference| {error:.3g} > {TOLERANCE}"


def check_policy_ran(session, policy, decode_steps, name=None, reuse=None):
    """The policy really served the decode, with a non-empty retrieval zone where it retrieves;
    a variant in ``REUSING`` re-selected exactly as often as its trigger says and kept its
    selection (checked by ``reuse``, a ``ReuseCount``) on the other steps."""
    if policy.is_dense:
        return
    cache = session.cache
    assert isinstance(cache, PolicyCache)
    assert cache.served == [0, 1]
    for state in cache.policy_layers():
        assert state.decode_steps == decode_steps
        if policy.selector is None:
            assert policy.local >= PROMPT + NEW_TOKENS, "the window should cover the context"
            continue
        assert state.store.zone_end > policy.sink, "the retrieval zone should not be empty"
        assert state.units.num_prompt_units > 0
        if policy.trigger.always_reselects or policy.first_selection == "first_step":
            assert int(state.reselections.min()) >= 1
        else:  # the prompt selected: the trigger may never have fired since
            assert bool(state.has_selection.all())
        if name in REUSING:
            assert state.reselections.tolist() == [REUSING[name](decode_steps)] * len(state.reselections)
        assert bool(state.store.retrieved.valid.any())
        if hasattr(state.units, "indexed"):  # an analytic index: generated tokens were indexed too
            flushed = int(state.units.indexed) - state.units.num_prompt_units
            buffer = state.units.update_buffer
            assert flushed == buffer * ((decode_steps - 1) // buffer)
    if name in REUSING:
        assert reuse is not None and reuse.reusing > 0 and reuse.admitted > 0, reuse


@pytest.mark.parametrize("preset_name", POLICIES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_matches_dense(reference, family, preset_name):
    model, ids, mask, plain, _ = reference(family)
    policy = make_policy(preset_name)
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        out = generate(model, ids, mask)
    check_policy_ran(session, policy, NEW_TOKENS - 1, preset_name, reuse)  # generate never feeds back its last token

    assert len(out.scores) == len(plain.scores) == NEW_TOKENS
    # step 0's logits come from the prefill forward
    assert_close(out.logits[0], plain.logits[0], "prefill logits")
    for step, (got, want) in enumerate(zip(out.scores, plain.scores)):
        assert_close(got, want, f"decode step {step} scores")
    for step, (got, want) in enumerate(zip(out.logits, plain.logits)):
        assert_close(got, want, f"decode step {step} logits")
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("preset_name", [name for name in POLICIES if not make_policy(name).is_dense])
def test_generate_attending_the_pool_by_slot_matches_dense(reference, preset_name, pools_attended_by_slot):
    """As a GPU pool's store does with ``store.ATTEND_POOL_BY_SLOT = True`` (an every-step policy's by
    default): the retrieved rows read from the pool by slot, none copied."""
    model, ids, mask, plain, _ = reference("llama")
    policy = make_policy(preset_name)
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        out = generate(model, ids, mask)
    check_policy_ran(session, policy, NEW_TOKENS - 1, preset_name, reuse)
    if policy.selector is not None:  # a unit cache keeps the buffer's rows: it copies them in
        assert all(state.store.attends_pool_by_slot == (state.store.cache is None)
                   for state in session.cache.policy_layers())
    for step, (got, want) in enumerate(zip(out.scores, plain.scores)):
        assert_close(got, want, f"decode step {step} scores")
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("preset_name", [name for name in POLICIES if not make_policy(name).is_dense
                                         and not make_policy(name).trigger.always_reselects])
def test_generate_with_the_pool_read_whole_and_copied_matches_dense(reference, preset_name, pools_as_on_a_gpu):
    """As a GPU pool's store does for a policy that keeps its selection (``ATTEND_POOL_BY_SLOT``'s default):
    a re-selection copies every selected row into the buffer (``fetch_whole``), attention reads the buffer."""
    model, ids, mask, plain, _ = reference("llama")
    policy = make_policy(preset_name)
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        out = generate(model, ids, mask)
    check_policy_ran(session, policy, NEW_TOKENS - 1, preset_name, reuse)
    stores = [state.store for state in session.cache.policy_layers()]
    assert stores and all(store.read_whole and not store.attends_pool_by_slot for store in stores)
    for step, (got, want) in enumerate(zip(out.scores, plain.scores)):
        assert_close(got, want, f"decode step {step} scores")
    assert torch.equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("preset_name", POLICIES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_manual_forward_matches_dense(reference, family, preset_name):
    model, ids, mask, generated, (plain_prefill, plain_steps, plain_tokens) = reference(family)
    # the manual loop is the same computation generate does
    assert torch.equal(plain_tokens, generated.sequences[:, PROMPT:])

    policy = make_policy(preset_name)
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        prefill, steps, tokens = manual_decode(model, ids, mask, session.new_cache())
    check_policy_ran(session, policy, NEW_TOKENS, preset_name, reuse)

    real = mask.bool()  # padding positions' logits are meaningless in both
    assert_close(prefill[real], plain_prefill[real], "prefill logits (every real position)")
    for step in range(NEW_TOKENS + 1):
        assert_close(steps[:, step], plain_steps[:, step], f"step {step} logits")
    assert torch.equal(tokens, plain_tokens)
