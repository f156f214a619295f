"""tests/gpu_cross.py: a cross product whose uncovered pairs run on the GPU only."""

import pytest

from gpu_cross import GPU_CROSS, cross


def test_cross_keeps_every_pair_and_marks_those_off_the_cpu():
    params = cross([("a", 1), ("b", 2)], ["x", "y", "z"], on_cpu=[(0, 0), (1, 1), (0, 2)])
    assert [p.values for p in params] == [("a", 1, "x"), ("a", 1, "y"), ("a", 1, "z"),
                                          ("b", 2, "x"), ("b", 2, "y"), ("b", 2, "z")]
    marked = [p.values for p in params if GPU_CROSS in p.marks]
    assert marked == [("a", 1, "y"), ("b", 2, "x"), ("b", 2, "z")]


def test_cross_refuses_a_subset_that_leaves_a_case_out():
    with pytest.raises(ValueError, match=r"second \[0, 1\] of 3"):
        cross(["a", "b"], ["x", "y", "z"], on_cpu=[(0, 0), (1, 1)])


def test_a_mapping_names_its_cases_in_the_ids():
    params = cross({"weak": {"margin": 0.5}, "mass": {"margin": -1.0}}, ["room", "evict"],
                   on_cpu=[(0, 0), (1, 1)])
    assert [p.id for p in params] == ["weak-room", "weak-evict", "mass-room", "mass-evict"]
    assert [p.values for p in params] == [({"margin": 0.5}, "room"), ({"margin": 0.5}, "evict"),
                                          ({"margin": -1.0}, "room"), ({"margin": -1.0}, "evict")]
    assert [GPU_CROSS in p.marks for p in params] == [False, True, True, False]
