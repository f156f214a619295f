"""LouisKV's one-time, per-model choice of tau.

On locally generated prompts, full attention's greedy output is the reference; LouisKV runs
teacher-forced along it at each candidate tau. A higher tau re-selects more often and tracks
full attention more closely. The chosen tau is the one with the fewest re-selections whose
top-1 agreement with full attention is within ``tolerance`` of the most eager candidate's.
The choice is stored in the calibration file and becomes the model's default tau.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from statistics import mean
from typing import Callable

from ..calibration import calibration_file, model_id
from ..errors import ConfigError
from ..presets import preset
from . import decode as decoding
from .fidelity import _kl
from .tasks import TASKS, build_chat, make_sample


@dataclass
class TauPoint:
    tau: float
    reselect_share: float
    top1_agreement: float
    kl_mean: float


def calibrate(
    model,
    tokenizer,
    *,
    taus=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95),
    samples: int = 200,
    length: int = 1024,
    steps: int = 32,
    budget: int = 512,
    tolerance: float = 0.01,
    save: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[float, list[TauPoint]]:
    """Returns ``(chosen_tau, points)`` and, with ``save``, stores the choice for this model."""
    taus = sorted(float(t) for t in taus)
    if not taus or any(not -1.0 <= t <= 1.0 for t in taus):
        raise ConfigError(f"taus must be numbers in [-1, 1], got {taus}")
    if budget >= length:
        raise ConfigError(
            f"budget {budget} covers the whole {length}-token prompt, so every tau attends to everything "
            "and nothing can be told apart; use a longer --length or a smaller --budget"
        )
    if samples < 1 or steps < 2:
        raise ConfigError(f"samples must be >= 1 and steps >= 2, got {samples} and {steps}")
    device = next(model.parameters()).device
    task_names = list(TASKS)
    shares: dict[float, list[float]] = {t: [] for t in taus}
    top1: dict[float, list[float]] = {t: [] for t in taus}
    kls: dict[float, list[float]] = {t: [] for t in taus}
    for i in range(samples):
        sample = make_sample(task_names[i % len(task_names)], tokenizer, length, seed=1000 + i)
        chat = build_chat(tokenizer, sample)
        shared = decoding.prefill(model, chat["input_ids"].to(device), chat["attention_mask"].to(device))
        reference = decoding.decode(model, shared, preset("full"), steps, keep_logits=True)
        for tau in taus:
            policy = preset("louiskv", budget=budget, trigger={"name": "query_cosine", "tau": tau})
            forced = decoding.decode(model, shared, policy, steps, forced=reference.tokens, keep_logits=True)
            kl, agree = _kl(reference.logits[1:], forced.logits[1:])  # step 0 is the shared prefill
            shares[tau].append(forced.reselect_share or 0.0)
            top1[tau].append(agree)
            kls[tau].append(kl)
        if progress is not None:
            progress(i + 1, samples)
    points = [TauPoint(t, mean(shares[t]), mean(top1[t]), mean(kls[t])) for t in taus]
    best_agreement = max(p.top1_agreement for p in points)
    good = [p for p in points if p.top1_agreement >= best_agreement - tolerance]
    chosen = min(good, key=lambda p: (p.reselect_share, -p.tau)).tau
    if save:
        path = calibration_file()
        path.parent.mkdir(parents=True, exist_ok=True)
        stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        stored[model_id(model)] = {
            "tau": chosen, "samples": samples, "length": length, "steps": steps, "budget": budget,
            "tolerance": tolerance, "points": [asdict(p) for p in points],
        }
        path.write_text(json.dumps(stored, indent=2), encoding="utf-8")
    return chosen, points
