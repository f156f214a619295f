"""The benchmark's compiled MLPs and RMSNorms compute what transformers' modules compute."""

from __future__ import annotations

import pytest
import torch

from kvpolicy.bench.compiled_layers import compile_mlp_and_norms

from conftest import build_model


@pytest.mark.parametrize("family,modules", [("qwen3", 11), ("llama", 7)])
def test_routed_modules_give_the_same_logits(family, modules):
    # the tiny models have 2 layers: 2 MLPs + 2 x 2 norms + the final norm (+ Qwen3's q/k norms)
    model = build_model(family)
    ids = torch.randint(1, 100, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        # "eager": dynamo traces the functions without code generation (inductor is for the GPU)
        assert compile_mlp_and_norms(model, backend="eager") == modules
        got = model(ids).logits
    assert torch.equal(got, want)


def test_a_model_without_such_modules_is_refused():
    with pytest.raises(ValueError, match="no \\*RMSNorm or gated \\*MLP"):
        compile_mlp_and_norms(torch.nn.Sequential(torch.nn.Linear(4, 4)), backend="eager")
