"""The layer's plan (kvpolicy/plan.py) must not keep its layer alive: a finished cache's KV
(tens of GB at 4 x 128K) is freed when its last reference goes, not when the collector runs."""

from __future__ import annotations

import gc
import weakref

import torch

import kvpolicy
from kvpolicy.layer import PolicyLayerState


def test_a_layer_state_is_freed_without_the_garbage_collector():
    state = PolicyLayerState(kvpolicy.preset("quest", budget=128), 0, torch.device("cpu"))
    ref = weakref.ref(state)
    gc.disable()
    try:
        del state
        assert ref() is None, "something holds the layer state in a reference cycle"
    finally:
        gc.enable()
