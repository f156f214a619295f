"""The K-means settings each preset builds its prompt units with (EVAL.md, "Fewer K-means iterations
for the prompt's units"): louiskv 3 iterations from spaced tokens with bf16 distances, clusterkv
KMeans' own defaults (8 iterations, split precision)."""

from __future__ import annotations

import pytest
import torch

import kvpolicy
from kvpolicy import Policy
from kvpolicy.units import KMeans


@pytest.mark.parametrize("model", [None, "smollm2"])
def test_louiskv_builds_its_prompt_units_with_three_bf16_iterations(model):
    policy = kvpolicy.preset("louiskv", model=model)
    assert policy.prefill_units == KMeans(tokens_per_cluster=16, iters=3, init="spaced", precision="bf16")
    assert policy.to_dict()["prefill_units"] == {"name": "kmeans", "tokens_per_cluster": 16, "iters": 3,
                                                 "init": "spaced", "precision": "bf16"}
    assert Policy.from_dict(policy.to_dict()) == policy


def test_louiskv_prompt_units_are_still_overridable_and_the_preset_does_not_share_its_dict():
    eight = {"name": "kmeans", "tokens_per_cluster": 16, "iters": 8, "precision": "split"}
    assert kvpolicy.preset("louiskv", prefill_units=eight).prefill_units == KMeans(tokens_per_cluster=16)
    # a caller mutating the spec it got back changes no later preset
    kvpolicy.preset("louiskv").to_dict()["prefill_units"]["iters"] = 1
    assert kvpolicy.preset("louiskv").prefill_units.iters == 3


def test_clusterkv_and_the_builder_keep_eight_split_iterations():
    assert KMeans().iters == 8 and KMeans().precision == "split" and KMeans().init == "spaced"
    assert kvpolicy.preset("clusterkv").prefill_units == KMeans(tokens_per_cluster=16)


def test_louiskv_prompt_units_cluster_the_prompt_keys():
    # on the reference ops, the preset's builder gives every valid token a label within the cluster
    # count, and its labels are the reference kmeans' at 3 bf16 iterations
    from kvpolicy.kernels import reference

    torch.manual_seed(0)
    keys = torch.randn(1, 2, 96, 16)
    valid = torch.ones(1, 96, dtype=torch.bool)
    builder = kvpolicy.preset("louiskv").prefill_units
    labels, clusters = builder.build_labels(keys, valid, "reference")
    assert clusters == 6 and labels.shape == (1, 2, 96) and int(labels.max()) < 6
    expected, _ = reference.kmeans(keys, valid, 6, 3, precision="bf16")
    assert torch.equal(labels, expected)
    # and not the 8-iteration split labels everywhere (the setting changed what is built)
    eight, _ = reference.kmeans(keys, valid, 6, 8)
    assert not torch.equal(labels, eight)
