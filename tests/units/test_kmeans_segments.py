"""K-means by segment (``KMeans(segment_tokens=...)``): each run of consecutive prompt tokens is
clustered on its own, so the prompt's K-means costs linearly in its length; a prompt no longer
than one segment is clustered exactly as without segments."""

from __future__ import annotations

import pytest
import torch

from kvpolicy import ConfigError, Policy
from kvpolicy.kernels import reference
from kvpolicy.units import KMeans


def _keys(batch=1, heads=2, n=100, dim=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=generator)


@pytest.mark.parametrize("n", [40, 64])
def test_a_prompt_within_one_segment_is_clustered_as_without_segments(n):
    keys, valid = _keys(n=n), torch.ones(1, n, dtype=torch.bool)
    valid[:, :3] = False
    whole, whole_count = KMeans(tokens_per_cluster=8, segment_tokens=None).build_labels(keys, valid, "reference")
    segmented, count = KMeans(tokens_per_cluster=8, segment_tokens=64).build_labels(keys, valid, "reference")
    assert count == whole_count == -(-n // 8)
    assert torch.equal(segmented, whole)


@pytest.mark.parametrize("init,precision", [("spaced", "split"), ("pages", "bf16")])
def test_each_segment_is_the_kmeans_of_its_own_tokens_under_its_own_labels(init, precision):
    # 100 tokens, segments of at most 32: four equal runs of 25 tokens, 4 clusters of 8 each
    keys = _keys(batch=2, n=100)
    valid = torch.ones(2, 100, dtype=torch.bool)
    valid[1, :30] = False  # a left-padded sequence: its first run is wholly invalid
    builder = KMeans(tokens_per_cluster=8, iters=3, init=init, precision=precision, segment_tokens=32)
    labels, count = builder.build_labels(keys, valid, "reference")
    assert count == 4 * 4 and labels.shape == (2, 2, 100)
    for run in range(4):
        part = slice(25 * run, 25 * (run + 1))
        expected, _ = reference.kmeans(keys[:, :, part].contiguous(), valid[:, part].contiguous(), 4, 3,
                                       init=init, precision=precision)
        assert torch.equal(labels[:, :, part], expected + 4 * run), run
    assert int(labels.min()) >= 0 and int(labels.max()) < count


def test_the_last_segment_is_padded_and_no_label_reaches_past_the_count():
    keys, valid = _keys(n=70), torch.ones(1, 70, dtype=torch.bool)
    labels, count = KMeans(tokens_per_cluster=16, segment_tokens=32).build_labels(keys, valid, "reference")
    # three runs of 24 (two padding tokens in the last), 2 clusters each
    assert count == 6 and labels.shape == (1, 2, 70)
    assert torch.equal(labels[..., :24] // 2, torch.zeros_like(labels[..., :24]))
    assert torch.equal(labels[..., 48:] // 2, torch.full_like(labels[..., 48:], 2))


@pytest.mark.parametrize("bad", [0, 8, 2.5, True, "4096"])
def test_a_segment_shorter_than_a_cluster_or_not_an_integer_is_refused_by_name(bad):
    with pytest.raises(ConfigError, match=r"kmeans: segment_tokens must be None .* >= tokens_per_cluster \(16\)"):
        Policy(trigger="every_step", prefill_units={"name": "kmeans", "segment_tokens": bad}, decode_units="pages",
               selector="top_budget", budget=256)


def test_segment_tokens_travels_in_the_policy_spec():
    policy = Policy(trigger="every_step", prefill_units={"name": "kmeans", "segment_tokens": 4096}, decode_units="pages",
                    selector="top_budget", budget=256)
    assert policy.to_dict()["prefill_units"]["segment_tokens"] == 4096
    assert Policy.from_dict(policy.to_dict()) == policy


def test_a_zone_sliced_from_the_prompt_is_clustered_as_its_copy():
    # build_index hands the builder keys[:, :, :zone], a view of the prompt's keys
    prompt, valid = _keys(n=100), torch.ones(1, 96, dtype=torch.bool)
    builder = KMeans(tokens_per_cluster=8, iters=2, segment_tokens=32)
    sliced, count = builder.build_labels(prompt[:, :, :96], valid, "reference")
    copied, _ = builder.build_labels(prompt[:, :, :96].contiguous(), valid, "reference")
    assert count == 3 * 4 and torch.equal(sliced, copied)


def test_the_default_runs_are_16384_tokens_and_a_cluster_larger_than_them_is_refused_naming_the_default():
    assert KMeans().segment_tokens == 16384
    with pytest.raises(ConfigError, match=r"got 16384 \(its default; pass segment_tokens=None or a larger run\)"):
        Policy(trigger="every_step", prefill_units={"name": "kmeans", "tokens_per_cluster": 20000}, decode_units="pages",
               selector="top_budget", budget=256)
    Policy(trigger="every_step", prefill_units={"name": "kmeans", "tokens_per_cluster": 20000, "segment_tokens": None},
           decode_units="pages", selector="top_budget", budget=256)
