"""LouisKV's one-time, per-model choice of tau, and the frontier it is chosen from.

On locally generated prompts, full attention's greedy output is the reference; LouisKV runs
teacher-forced along it at each candidate tau, and once more with an every-step trigger and the
same units (the reference for what re-selecting buys). A higher tau re-selects more often and
tracks full attention more closely. Every candidate's re-selection share, top-1 agreement and KL
are reported and stored (the whole frontier, see ``frontier``), not only the chosen one.

The rule (``choose``; ``RULE`` says it in words): among the candidate taus, the one with the fewest
re-selections whose top-1 agreement with full attention is within ``tolerance`` (0.02: 2 points) of
the best candidate's; ties go to the higher tau. The every-step row is reported beside the
candidates but does not enter the rule. The choice is stored in the calibration file and becomes
the model's default tau.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
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
    tau: float | None  # None: the every-step reference
    reselect_share: float
    top1_agreement: float
    kl_mean: float


@dataclass
class TauMeasurements:
    """Per-sample figures for each tau; shards measured apart are merged by ``merge``."""

    model: str
    length: int
    steps: int
    budget: int
    taus: list[float]
    sample_ids: list[int]
    reselect_share: dict[str, list[float]]  # str(tau) -> one value per sample
    top1_agreement: dict[str, list[float]]
    kl_mean: dict[str, list[float]]
    against: str = "previous"  # the trigger's reference query
    # the every-step trigger with the same units and budget, one value per sample (empty: not measured)
    every_step_top1: list[float] = field(default_factory=list)
    every_step_kl: list[float] = field(default_factory=list)

    def points(self) -> list[TauPoint]:
        return [TauPoint(t, mean(self.reselect_share[str(t)]), mean(self.top1_agreement[str(t)]),
                         mean(self.kl_mean[str(t)])) for t in self.taus]

    def every_step(self) -> TauPoint | None:
        """The every-step reference as a point (``tau`` is None; it re-selects at every step), if measured."""
        if not self.every_step_top1 or len(self.every_step_top1) != len(self.sample_ids):
            return None
        return TauPoint(None, 1.0, mean(self.every_step_top1), mean(self.every_step_kl))


RULE = ("the candidate tau with the fewest re-selections whose top-1 agreement with full attention is within "
        "{points:g} points of the best candidate's ({best:.1%}); ties go to the higher tau")


@dataclass
class FrontierRow:
    """One measured setting of a calibration, as ``kvpolicy calibrate`` reports and stores it."""

    tau: float | None  # None: the every-step reference
    reselect_share: float
    top1_agreement: float
    kl_mean: float
    pareto: bool  # no other row re-selects as rarely or less and agrees as well or better, one strictly
    within_tolerance: bool  # passes the rule's agreement test (the every-step row: whether it would)
    chosen: bool

    @property
    def label(self) -> str:
        return "every step" if self.tau is None else f"{self.tau:.2f}"


def frontier(measured: TauMeasurements, tolerance: float = 0.02, chosen: float | None = None) -> list[FrontierRow]:
    """Every candidate tau, then the every-step reference (if measured), with the rule's verdicts.

    ``chosen`` defaults to ``choose(points, tolerance)``; pass NaN for none (a shard's figures).
    """
    points = measured.points()
    if chosen is None:
        chosen = choose(points, tolerance)
    best = max(p.top1_agreement for p in points)
    reference = measured.every_step()
    rows_in = points + ([reference] if reference is not None else [])

    def dominated(p: TauPoint) -> bool:
        return any(o is not p and o.reselect_share <= p.reselect_share and o.top1_agreement >= p.top1_agreement
                   and (o.reselect_share < p.reselect_share or o.top1_agreement > p.top1_agreement)
                   for o in rows_in)

    return [FrontierRow(p.tau, p.reselect_share, p.top1_agreement, p.kl_mean, not dominated(p),
                        p.top1_agreement >= best - tolerance, p.tau is not None and p.tau == chosen)
            for p in rows_in]


def describe_rule(measured: TauMeasurements, tolerance: float) -> str:
    return RULE.format(points=100 * tolerance, best=max(p.top1_agreement for p in measured.points()))


def frontier_table(measured: TauMeasurements, tolerance: float = 0.02, chosen: float | None = None) -> str:
    """The frontier as the text ``kvpolicy calibrate`` prints."""
    rows = frontier(measured, tolerance, chosen)
    reference = measured.every_step()
    lines = [f"{'tau':>10s} {'re-selecting':>13s} {'top-1 agree':>12s} {'vs every step':>14s} {'KL':>8s}"]
    for r in rows:
        versus = "-" if reference is None else f"{100 * (r.top1_agreement - reference.top1_agreement):+.1f} pt"
        marks = [m for m, on in (("frontier", r.pareto), ("within tolerance", r.within_tolerance and r.tau is not None),
                                 ("<- chosen", r.chosen)) if on]
        lines.append(f"{r.label:>10s} {100 * r.reselect_share:12.1f}% {100 * r.top1_agreement:11.1f}% "
                     f"{versus:>14s} {r.kl_mean:8.4f}  {', '.join(marks)}".rstrip())
    lines.append(f"rule: {describe_rule(measured, tolerance)}")
    return "\n".join(lines)


def _check_taus(taus) -> list[float]:
    taus = sorted(float(t) for t in taus)
    if not taus or any(not -1.0 <= t <= 1.0 for t in taus):
        raise ConfigError(f"taus must be numbers in [-1, 1], got {taus}")
    return taus


def measure_taus(
    model,
    tokenizer,
    *,
    taus=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95),
    sample_ids=range(200),
    length: int = 1024,
    steps: int = 32,
    budget: int = 512,
    against: str = "previous",
    every_step: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> TauMeasurements:
    """Teacher-forced LouisKV at each tau along full attention's output, sample by sample; with
    ``every_step``, also the every-step trigger with the same units (one more decode per sample).

    Sample ``i`` is task ``i mod 8`` made with seed ``1000 + i``, so shards with disjoint
    ``sample_ids`` measure disjoint prompts.
    """
    taus = _check_taus(taus)
    sample_ids = list(sample_ids)
    if budget >= length:
        raise ConfigError(
            f"budget {budget} covers the whole {length}-token prompt, so every tau attends to everything "
            "and nothing can be told apart; use a longer --length or a smaller --budget"
        )
    if not sample_ids or steps < 2:
        raise ConfigError(f"give at least one sample and steps >= 2, got {len(sample_ids)} samples and {steps} steps")
    device = next(model.parameters()).device
    task_names = list(TASKS)
    shares: dict[str, list[float]] = {str(t): [] for t in taus}
    top1: dict[str, list[float]] = {str(t): [] for t in taus}
    kls: dict[str, list[float]] = {str(t): [] for t in taus}
    every_top1: list[float] = []
    every_kl: list[float] = []
    for done, i in enumerate(sample_ids, 1):
        sample = make_sample(task_names[i % len(task_names)], tokenizer, length, seed=1000 + i)
        chat = build_chat(tokenizer, sample)
        shared = decoding.prefill(model, chat["input_ids"].to(device), chat["attention_mask"].to(device))
        reference = decoding.decode(model, shared, preset("full"), steps, keep_logits=True)
        for tau in taus:
            policy = preset("louiskv", budget=budget, trigger={"name": "query_cosine", "tau": tau, "against": against})
            forced = decoding.decode(model, shared, policy, steps, forced=reference.tokens, keep_logits=True)
            kl, agree = _kl(reference.logits[1:], forced.logits[1:])  # step 0 is the shared prefill
            shares[str(tau)].append(forced.reselect_share or 0.0)
            top1[str(tau)].append(agree)
            kls[str(tau)].append(kl)
        if every_step:
            policy = preset("louiskv", budget=budget, trigger={"name": "every_step"})
            forced = decoding.decode(model, shared, policy, steps, forced=reference.tokens, keep_logits=True)
            kl, agree = _kl(reference.logits[1:], forced.logits[1:])
            every_top1.append(agree)
            every_kl.append(kl)
        if progress is not None:
            progress(done, len(sample_ids))
    return TauMeasurements(model_id(model), length, steps, budget, taus, sample_ids, shares, top1, kls, against,
                           every_top1, every_kl)


def merge(shards: list[TauMeasurements]) -> TauMeasurements:
    """One measurement from shards of the same setting over disjoint samples."""
    first = shards[0]
    for other in shards[1:]:
        same = (other.model, other.length, other.steps, other.budget, other.taus, other.against)
        if same != (first.model, first.length, first.steps, first.budget, first.taus, first.against):
            raise ConfigError(f"cannot merge calibration shards of different settings: {same} vs "
                              f"{(first.model, first.length, first.steps, first.budget, first.taus, first.against)}")
    ids = [i for s in shards for i in s.sample_ids]
    if len(set(ids)) != len(ids):
        raise ConfigError("calibration shards overlap: a sample was measured twice")

    def joined(name: str) -> dict[str, list[float]]:
        return {str(t): [v for s in shards for v in getattr(s, name)[str(t)]] for t in first.taus}

    # the every-step reference only where every shard measured it: a subset's mean would mislead
    whole = all(s.every_step() is not None for s in shards)
    every_top1 = [v for s in shards for v in s.every_step_top1] if whole else []
    every_kl = [v for s in shards for v in s.every_step_kl] if whole else []
    return TauMeasurements(first.model, first.length, first.steps, first.budget, first.taus, ids,
                           joined("reselect_share"), joined("top1_agreement"), joined("kl_mean"), first.against,
                           every_top1, every_kl)


def choose(points: list[TauPoint], tolerance: float = 0.02) -> float:
    """The tau with the fewest re-selections among those within ``tolerance`` of the best top-1
    agreement (``RULE``); of equal re-selection shares, the higher tau."""
    best_agreement = max(p.top1_agreement for p in points)
    good = [p for p in points if p.top1_agreement >= best_agreement - tolerance]
    return min(good, key=lambda p: (p.reselect_share, -p.tau)).tau


def store(measured: TauMeasurements, chosen: float, tolerance: float) -> None:
    """Write the choice to the calibration file, where it becomes the model's default tau."""
    if measured.against != "previous":
        raise ConfigError(
            f"these figures were measured with against={measured.against!r}; the louiskv preset compares with the "
            "previous query, so its tau is calibrated with against='previous' only"
        )
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    rows = frontier(measured, tolerance, chosen)
    stored[measured.model] = {
        "tau": chosen, "samples": len(measured.sample_ids), "length": measured.length, "steps": measured.steps,
        "budget": measured.budget, "tolerance": tolerance, "rule": describe_rule(measured, tolerance),
        # every candidate tau, as measured, with the rule's verdicts: the whole frontier
        "points": [asdict(r) for r in rows if r.tau is not None],
        "every_step": next((asdict(r) for r in rows if r.tau is None), None),
    }
    path.write_text(json.dumps(stored, indent=2), encoding="utf-8")


def calibrate(
    model,
    tokenizer,
    *,
    taus=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95),
    samples: int = 200,
    length: int = 1024,
    steps: int = 32,
    budget: int = 512,
    tolerance: float = 0.02,
    save: bool = True,
    every_step: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[float, list[TauPoint]]:
    """Returns ``(chosen_tau, points)`` and, with ``save``, stores the choice and the whole frontier
    (see ``frontier``) for this model."""
    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    measured = measure_taus(model, tokenizer, taus=taus, sample_ids=range(samples), length=length, steps=steps,
                            budget=budget, every_step=every_step, progress=progress)
    points = measured.points()
    chosen = choose(points, tolerance)
    if save:
        store(measured, chosen, tolerance)
    return chosen, points
