"""The K-means settings each preset builds its prompt units with (EVAL.md, "Fewer K-means iterations
for the prompt's units"): louiskv and clusterkv KMeans' own defaults (8 iterations, split precision);
``presets.FAST_PROMPT_UNITS`` (3 iterations from spaced tokens, bf16 distances) by name."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import Policy
from kvpolicy.presets import FAST_PROMPT_UNITS
from kvpolicy.units import KMeans


@pytest.mark.parametrize("model", [None, "smollm2"])
def test_louiskv_builds_its_prompt_units_with_kmeans_defaults(model):
    policy = kvpolicy.preset("louiskv", model=model)
    assert policy.prefill_units == KMeans(tokens_per_cluster=16)
    assert Policy.from_dict(policy.to_dict()) == policy


def test_the_fast_prompt_units_are_three_bf16_iterations_and_the_preset_does_not_share_its_dict():
    fast = kvpolicy.preset("louiskv", prefill_units=FAST_PROMPT_UNITS)
    assert fast.prefill_units == KMeans(tokens_per_cluster=16, iters=3, init="spaced", precision="bf16")
    spec = fast.to_dict()["prefill_units"]
    assert {k: spec[k] for k in FAST_PROMPT_UNITS} == FAST_PROMPT_UNITS and spec["segment_tokens"] == 16384
    # a caller mutating the spec it got back changes no later preset
    kvpolicy.preset("louiskv").to_dict()["prefill_units"]["iters"] = 1
    fast.to_dict()["prefill_units"]["iters"] = 1
    assert kvpolicy.preset("louiskv").prefill_units.iters == 8 and FAST_PROMPT_UNITS["iters"] == 3


def test_clusterkv_and_the_builder_keep_eight_split_iterations():
    assert KMeans().iters == 8 and KMeans().precision == "split" and KMeans().init == "spaced"
    assert kvpolicy.preset("clusterkv").prefill_units == KMeans(tokens_per_cluster=16)


def test_fast_prompt_units_cluster_the_prompt_keys():
    # on the reference ops, the fast builder gives every valid token a label within the cluster
    # count, and its labels are the reference kmeans' at 3 bf16 iterations
    from kvpolicy.kernels import reference

    torch.manual_seed(0)
    keys = torch.randn(1, 2, 96, 16)
    valid = torch.ones(1, 96, dtype=torch.bool)
    builder = kvpolicy.preset("louiskv", prefill_units=FAST_PROMPT_UNITS).prefill_units
    labels, clusters = builder.build_labels(keys, valid, "reference")
    assert clusters == 6 and labels.shape == (1, 2, 96) and int(labels.max()) < 6
    expected, _ = reference.kmeans(keys, valid, 6, 3, precision="bf16")
    assert torch.equal(labels, expected)
    # and not the 8-iteration split labels everywhere (the setting changed what is built)
    eight, _ = reference.kmeans(keys, valid, 6, 8)
    assert not torch.equal(labels, eight)
