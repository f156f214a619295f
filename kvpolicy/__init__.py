"""kvpolicy: pluggable KV-cache retrieval policies for long-context decoding.

    import kvpolicy
    policy = kvpolicy.preset("louiskv", budget=512)
    with policy.apply(model):
        model.generate(**inputs, max_new_tokens=256)
"""

from . import selectors, triggers, units  # noqa: F401  (registers the built-ins)
from .errors import (
    BackendUnavailableError,
    ConfigError,
    KVPolicyError,
    ModelNotFoundError,
    UnknownNameError,
    UnsupportedModelError,
)
from .policy import Policy
from .presets import PRESETS, preset
from .registry import load_plugin_module, register
from .selectors import Selection, Selector
from .triggers import Trigger
from .units import UnitBuilder

__version__ = "0.1.0"

__all__ = [
    "Policy",
    "preset",
    "PRESETS",
    "register",
    "load_plugin_module",
    "Trigger",
    "UnitBuilder",
    "Selector",
    "Selection",
    "KVPolicyError",
    "ConfigError",
    "UnknownNameError",
    "BackendUnavailableError",
    "UnsupportedModelError",
    "ModelNotFoundError",
]
