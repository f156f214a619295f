"""The calibration store: per-model calibrated LouisKV tau, one value per model, chosen once and
reused as its default (what ``preset("louiskv", model=...)`` reads). The calibration run that
measures and writes it is ``kvpolicy.eval.calibrate`` (``kvpolicy calibrate``).

Lookup order: the user's calibration file (``$KVPOLICY_CACHE/calibration.json``, written by
``kvpolicy calibrate``), then the values measured for models kvpolicy ships with, then the
published default 0.7 (LouisKV's value for Qwen3-8B).

Each value is the one ``kvpolicy calibrate``'s rule chooses (``kvpolicy.eval.calibrate.RULE``): the
candidate tau with the fewest re-selections whose top-1 agreement with full attention is within 2
points of the best candidate's. The calibration file also keeps every candidate's figures.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

DEFAULT_TAU = 0.7

# `kvpolicy calibrate` on SmolLM2-135M-Instruct (EVAL.md, "Calibrating tau"): over 200 local
# prompts of 1024 tokens, budget 256, only tau 0.95 keeps top-1 agreement with full attention
# within 2 points of the most eager candidate (96.8%; 0.9 gives 94.7%, 0.8 80.7%), at 91% of
# (layer, step) pairs re-selecting. On this model LouisKV's reuse costs accuracy at any lower tau.
BUILTIN_TAU: dict[str, float] = {"smollm2-135m-instruct": 0.95}


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
