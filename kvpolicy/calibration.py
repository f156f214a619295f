"""Per-model calibrated LouisKV tau: one value per model, chosen once and reused as its default.

Lookup order: the user's calibration file (``$KVPOLICY_CACHE/calibration.json``, written by
``kvpolicy calibrate``), then the values measured for models kvpolicy ships with, then the
published default 0.7 (LouisKV's value for Qwen3-8B).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_TAU = 0.7

# Measured on the built-in needle demo (4K tokens, budget 512): at 0.7 SmolLM2-135M's
# consecutive queries stay too similar for LouisKV to re-select before the answer, and the
# answer is lost; at 0.8 it re-selects in time (see the closing note of issue 2).
BUILTIN_TAU: dict[str, float] = {"smollm2-135m-instruct": 0.8}


def calibration_file() -> Path:
    root = Path(os.environ.get("KVPOLICY_CACHE", Path.home() / ".cache" / "kvpolicy"))
    return root / "calibration.json"


def model_id(model: Any) -> str:
    """A stable name for a model: its config's name or path, last component, lower case."""
    if isinstance(model, str):
        name = model
    else:
        config = getattr(model, "config", None)
        name = getattr(config, "_name_or_path", "") or type(model).__name__
    return Path(str(name).rstrip("/")).name.lower()


def calibrated_tau(model: Any) -> float:
    """The tau to use for ``model`` (a model object or its id)."""
    key = model_id(model)
    path = calibration_file()
    if path.exists():
        try:
            stored = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            stored = {}
        entry = stored.get(key)
        if isinstance(entry, dict) and isinstance(entry.get("tau"), (int, float)):
            return float(entry["tau"])
    return BUILTIN_TAU.get(key, DEFAULT_TAU)
