"""The anchor test on a GPU: with pools in GPU memory (``placement="gpu"``) and a budget covering the whole
context, every preset's ``generate`` reproduces dense attention through the Triton kernels, on both ways a GPU
pool is read (``store.ATTEND_POOL_BY_SLOT``'s default): a policy that keeps its selection copies its rows into
the buffer at a re-selection; a policy that re-selects at every step attends them in the pool by slot.
The CPU suite runs the same paths with the reference kernels (``pools_as_on_a_gpu``)."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from conftest import build_model, left_padded_batch
from every_preset import EVERY_PRESET, VARIANTS
from integration.test_dense_equivalence import BUDGET, NEW_TOKENS, PROMPT, check_policy_ran, generate, make_policy
from reuse_check import checking_reuse

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = 1e-4  # the kernels' dots are IEEE float32, as the dense path's matmuls are (no TF32)


@pytest.fixture(scope="module")
def on_gpu():
    model = build_model("llama").cuda()
    ids, mask = (tensor.cuda() for tensor in left_padded_batch(PROMPT))
    with torch.no_grad():
        plain = generate(model, ids, mask)
    return model, ids, mask, plain


def gpu_policy(name: str) -> kvpolicy.Policy:
    name, options = VARIANTS.get(name, (name, {}))
    return kvpolicy.preset(name, budget=BUDGET, placement="gpu", backend="triton", **options)


@pytest.mark.parametrize("preset_name", [name for name in EVERY_PRESET if not make_policy(name).is_dense])
def test_generate_on_a_gpu_pool_matches_dense(on_gpu, preset_name):
    model, ids, mask, plain = on_gpu
    policy = gpu_policy(preset_name)
    with torch.no_grad(), policy.apply(model) as session, checking_reuse() as reuse:
        out = generate(model, ids, mask)
    check_policy_ran(session, policy, NEW_TOKENS - 1, preset_name, reuse)
    if policy.selector is not None:
        for state in session.cache.policy_layers():
            store = state.store
            assert store.pool.keys.device.type == "cuda" and store.read_whole
            by_slot = policy.trigger.always_reselects and store.cache is None  # a unit cache copies its rows
            assert store.attends_pool_by_slot == by_slot, (preset_name, store.attends_pool_by_slot)
    for step, (got, want) in enumerate(zip(out.scores, plain.scores)):
        error = (got - want).abs().max().item()
        assert error <= TOLERANCE, f"decode step {step} scores: max |difference| {error:.3g} > {TOLERANCE}"
    assert torch.equal(out.sequences, plain.sequences)
