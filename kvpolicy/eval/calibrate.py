"""The calibration run: LouisKV's one-time, per-model choice of its trigger setting, and the
frontier it is chosen from (``kvpolicy calibrate``). The store it writes, and that presets read, is
``kvpolicy.calibration``.

On locally generated prompts, full attention's greedy output is the reference; LouisKV runs
teacher-forced along it at each candidate setting of one trigger (``score_gap``'s margin, the
louiskv preset's trigger, or ``query_cosine``'s tau, the paper's), and once more with an every-step
trigger and the same units: the reference for what reuse may cost. Every candidate's re-selection
share, top-1 agreement and KL are reported and stored (the whole frontier, see ``frontier``), not
only the chosen one.

The rule (``choose``; ``RULE`` says it in words): the cheapest setting, i.e. the candidate with the
fewest re-selections, whose top-1 agreement with full attention is within ``tolerance`` (0.02: 2
points) of every-step selection's with the same units; ties go to the more eager setting (higher
tau, lower margin). If no candidate is within it, the one that agrees best. Figures without the
every-step row (shards from before it was measured) are held to the best candidate instead. The
choice is stored in the calibration file and becomes the model's default (``presets``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from statistics import mean
from typing import Callable

from ..calibration import calibration_file, model_id
from ..errors import ConfigError
from ..presets import preset
from . import decode as decoding
from .defaults import (CALIBRATION_BUDGET, CALIBRATION_LENGTH, CALIBRATION_SAMPLES, CALIBRATION_STEPS,
                       CALIBRATION_TAUS, CALIBRATION_TOLERANCE)
from .fidelity import _kl
from .tasks import TASKS, build_chat, make_sample


# the option each calibrated trigger sweeps, and whether a higher value re-selects more often
PARAMETER = {"query_cosine": "tau", "score_gap": "margin"}
HIGHER_IS_EAGER = {"query_cosine": True, "score_gap": False}


@dataclass
class TauPoint:
    tau: float | None  # the swept option's value (tau, margin); None: the every-step reference
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
    taus: list[float]  # the swept option's values: tau for query_cosine, margin for score_gap
    sample_ids: list[int]
    reselect_share: dict[str, list[float]]  # str(tau) -> one value per sample
    top1_agreement: dict[str, list[float]]
    kl_mean: dict[str, list[float]]
    against: str = "previous"  # the trigger's reference query
    # the every-step trigger with the same units and budget, one value per sample (empty: not measured)
    every_step_top1: list[float] = field(default_factory=list)
    every_step_kl: list[float] = field(default_factory=list)
    trigger: str = "query_cosine"  # the trigger calibrated (figures from before it was recorded: query_cosine)
    options: dict = field(default_factory=dict)  # its other options, fixed (score_gap's measure)

    @property
    def parameter(self) -> str:
        return PARAMETER[self.trigger]

    def spec(self, value: float) -> dict:
        """The trigger spec of one candidate (as ``Policy``'s ``trigger`` takes it)."""
        if self.trigger == "query_cosine":
            return {"name": "query_cosine", "tau": value, "against": self.against}
        return {"name": self.trigger, **self.options, self.parameter: value}

    def points(self) -> list[TauPoint]:
        return [TauPoint(t, mean(self.reselect_share[str(t)]), mean(self.top1_agreement[str(t)]),
                         mean(self.kl_mean[str(t)])) for t in self.taus]

    def every_step(self) -> TauPoint | None:
        """The every-step reference as a point (``tau`` is None; it re-selects at every step), if measured."""
        if not self.every_step_top1 or len(self.every_step_top1) != len(self.sample_ids):
            return None
        return TauPoint(None, 1.0, mean(self.every_step_top1), mean(self.every_step_kl))


RULE = ("the {name} setting with the fewest re-selections whose top-1 agreement with full attention is within "
        "{points:g} points of every-step selection's with the same units ({reference:.1%}); ties go to the more "
        "eager setting ({eager} {parameter}); if none is within, the one that agrees best")
RULE_WITHOUT_REFERENCE = ("the {name} setting with the fewest re-selections whose top-1 agreement with full attention "
                          "is within {points:g} points of the best candidate's ({reference:.1%}; these figures have "
                          "no every-step row); ties go to the more eager setting ({eager} {parameter})")


def reference_agreement(measured: "TauMeasurements") -> float:
    """What the rule holds candidates to: every-step selection's top-1 agreement, else the best candidate's."""
    reference = measured.every_step()
    if reference is not None:
        return reference.top1_agreement
    return max(p.top1_agreement for p in measured.points())


@dataclass
class FrontierRow:
    """One measured setting of a calibration, as ``kvpolicy calibrate`` reports and stores it."""

    tau: float | None  # the swept option's value; None: the every-step reference
    reselect_share: float
    top1_agreement: float
    kl_mean: float
    pareto: bool  # no other row re-selects as rarely or less and agrees as well or better, one strictly
    within_tolerance: bool  # passes the rule's agreement test (the every-step row: whether it would)
    chosen: bool

    @property
    def label(self) -> str:
        return "every step" if self.tau is None else f"{self.tau:.2f}"


def frontier(measured: TauMeasurements, tolerance: float = CALIBRATION_TOLERANCE,
             chosen: float | None = None) -> list[FrontierRow]:
    """Every candidate tau, then the every-step reference (if measured), with the rule's verdicts.

    ``chosen`` defaults to ``choose_for(measured, tolerance)``; pass NaN for none (a shard's figures).
    """
    points = measured.points()
    if chosen is None:
        chosen = choose_for(measured, tolerance)
    best = reference_agreement(measured)
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
    text = RULE if measured.every_step() is not None else RULE_WITHOUT_REFERENCE
    return text.format(name=measured.trigger, points=100 * tolerance, reference=reference_agreement(measured),
                       eager="higher" if HIGHER_IS_EAGER[measured.trigger] else "lower", parameter=measured.parameter)


def frontier_table(measured: TauMeasurements, tolerance: float = CALIBRATION_TOLERANCE,
                   chosen: float | None = None) -> str:
    """The frontier as the text ``kvpolicy calibrate`` prints."""
    rows = frontier(measured, tolerance, chosen)
    reference = measured.every_step()
    lines = [f"{measured.parameter:>10s} {'re-selecting':>13s} {'top-1 agree':>12s} {'vs every step':>14s} {'KL':>8s}"]
    for r in rows:
        versus = "-" if reference is None else f"{100 * (r.top1_agreement - reference.top1_agreement):+.1f} pt"
        marks = [m for m, on in (("frontier", r.pareto), ("within tolerance", r.within_tolerance and r.tau is not None),
                                 ("<- chosen", r.chosen)) if on]
        lines.append(f"{r.label:>10s} {100 * r.reselect_share:12.1f}% {100 * r.top1_agreement:11.1f}% "
                     f"{versus:>14s} {r.kl_mean:8.4f}  {', '.join(marks)}".rstrip())
    lines.append(f"rule: {describe_rule(measured, tolerance)}")
    return "\n".join(lines)


def _check_taus(taus, trigger: str = "query_cosine") -> list[float]:
    taus = sorted(float(t) for t in taus)
    if trigger not in PARAMETER:
        raise ConfigError(f"calibrate: cannot calibrate trigger {trigger!r}; calibrated triggers: {', '.join(PARAMETER)}")
    if not taus or any(t != t for t in taus):
        raise ConfigError(f"give at least one {PARAMETER[trigger]}, got {taus}")
    if trigger == "query_cosine" and any(not -1.0 <= t <= 1.0 for t in taus):
        raise ConfigError(f"taus must be numbers in [-1, 1], got {taus}")
    return taus


def measure_taus(
    model,
    tokenizer,
    *,
    taus=CALIBRATION_TAUS,
    sample_ids=range(CALIBRATION_SAMPLES),
    length: int = CALIBRATION_LENGTH,
    steps: int = CALIBRATION_STEPS,
    budget: int = CALIBRATION_BUDGET,
    against: str = "previous",
    every_step: bool = True,
    progress: Callable[[int, int], None] | None = None,
    trigger: str = "query_cosine",
    options: dict | None = None,
) -> TauMeasurements:
    """Teacher-forced LouisKV at each value of ``trigger``'s swept option (``taus``: tau for
    ``query_cosine``, margin for ``score_gap``, whose other ``options`` stay fixed) along full
    attention's output, sample by sample; with ``every_step``, also the every-step trigger with the
    same units (one more decode per sample).

    Sample ``i`` is task ``i mod 8`` made with seed ``1000 + i``, so shards with disjoint
    ``sample_ids`` measure disjoint prompts.
    """
    taus = _check_taus(taus, trigger)
    options = dict(options or {})
    spec_of = TauMeasurements("", 0, 0, 0, [], [], {}, {}, {}, against, trigger=trigger, options=options).spec
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
            policy = preset("louiskv", budget=budget, trigger=spec_of(tau))
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
                           every_top1, every_kl, trigger, options)


def merge(shards: list[TauMeasurements]) -> TauMeasurements:
    """One measurement from shards of the same setting over disjoint samples."""
    first = shards[0]
    for other in shards[1:]:
        def setting(m):
            return (m.model, m.length, m.steps, m.budget, m.taus, m.against, m.trigger, m.options)

        if setting(other) != setting(first):
            raise ConfigError(f"cannot merge calibration shards of different settings: {setting(other)} vs "
                              f"{setting(first)}")
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
                           every_top1, every_kl, first.trigger, first.options)


def choose(points: list[TauPoint], tolerance: float = CALIBRATION_TOLERANCE, reference: float | None = None,
           higher_is_eager: bool = True) -> float:
    """``RULE``: the setting with the fewest re-selections among those whose top-1 agreement is within
    ``tolerance`` of ``reference`` (every-step selection's agreement; None: the best candidate's); of
    equal re-selection shares, the more eager one (the higher value if ``higher_is_eager``). If none
    is within, the best-agreeing setting (of equal agreement, the cheaper)."""
    if reference is None:
        reference = max(p.top1_agreement for p in points)
    sign = -1.0 if higher_is_eager else 1.0
    good = [p for p in points if p.top1_agreement >= reference - tolerance - 1e-12]
    if not good:
        return max(points, key=lambda p: (p.top1_agreement, -p.reselect_share)).tau
    return min(good, key=lambda p: (p.reselect_share, sign * p.tau)).tau


def tokens_needed(tolerance: float) -> int:
    """The teacher-forced tokens a calibration must measure before its choice is stored: enough
    that one token weighs at most a quarter of ``tolerance`` (200 at 2 points). With fewer, one
    token decides the rule: Gemma 3 at 4 prompts x 16 steps (1.6 points a token) put every margin
    "within 2 points" and took one that never re-selected, which lost every needle (EVAL.md)."""
    return math.ceil(4 / tolerance) if tolerance > 0 else 0


def check_evidence(measured: "TauMeasurements", tolerance: float, min_tokens: int | None = None) -> None:
    """Refuse to store a choice from fewer than ``min_tokens`` (default ``tokens_needed``) tokens."""
    needed = tokens_needed(tolerance) if min_tokens is None else min_tokens
    tokens = len(measured.sample_ids) * measured.steps
    if tokens < needed:
        raise ConfigError(
            f"calibrate measured {tokens} tokens ({len(measured.sample_ids)} prompts x {measured.steps} steps), so one "
            f"token moves agreement by {100 / tokens:.1f} points against a tolerance of {100 * tolerance:g}; the rule "
            f"needs at least {needed} tokens before it may store a choice: give more --samples (or --steps), merge "
            "more shards, or pass --min-tokens to accept fewer"
        )


def choose_for(measured: TauMeasurements, tolerance: float = CALIBRATION_TOLERANCE) -> float:
    """``choose`` with the rule's reference (``reference_agreement``) and ``measured``'s trigger's direction."""
    return choose(measured.points(), tolerance, reference_agreement(measured), HIGHER_IS_EAGER[measured.trigger])


def store(measured: TauMeasurements, chosen: float, tolerance: float) -> None:
    """Write the choice to the calibration file, where it becomes the model's default.

    A model's entry keeps one record per calibrated trigger (under its name: the chosen setting,
    the rule and the whole frontier). ``query_cosine``'s tau is also the entry's ``tau`` (the paper's
    trigger's default, ``calibration.calibrated_tau``); ``score_gap``'s choice is the entry's
    ``trigger``, the louiskv preset's default trigger for the model (``presets.louiskv_trigger``).
    """
    if measured.trigger == "query_cosine" and measured.against != "previous":
        raise ConfigError(
            f"these figures were measured with against={measured.against!r}; the paper's trigger compares with the "
            "previous query, so its tau is calibrated with against='previous' only"
        )
    path = calibration_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    stored = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    rows = frontier(measured, tolerance, chosen)
    record = {
        measured.parameter: chosen, "trigger": measured.spec(chosen), "samples": len(measured.sample_ids),
        "length": measured.length, "steps": measured.steps, "budget": measured.budget, "tolerance": tolerance,
        "rule": describe_rule(measured, tolerance),
        # every candidate, as measured, with the rule's verdicts: the whole frontier
        "points": [asdict(r) for r in rows if r.tau is not None],
        "every_step": next((asdict(r) for r in rows if r.tau is None), None),
    }
    entry = stored.get(measured.model)
    entry = dict(entry) if isinstance(entry, dict) else {}
    entry[measured.trigger] = record
    if measured.trigger == "query_cosine":
        entry["tau"] = chosen
    else:
        entry["trigger"] = measured.spec(chosen)
    stored[measured.model] = entry
    path.write_text(json.dumps(stored, indent=2), encoding="utf-8")


def calibrate(
    model,
    tokenizer,
    *,
    taus=CALIBRATION_TAUS,
    samples: int = CALIBRATION_SAMPLES,
    length: int = CALIBRATION_LENGTH,
    steps: int = CALIBRATION_STEPS,
    budget: int = CALIBRATION_BUDGET,
    tolerance: float = CALIBRATION_TOLERANCE,
    save: bool = True,
    every_step: bool = True,
    progress: Callable[[int, int], None] | None = None,
    trigger: str = "query_cosine",
    options: dict | None = None,
    min_tokens: int | None = None,
) -> tuple[float, list[TauPoint]]:
    """Returns ``(chosen, points)`` (``taus``: the values of ``trigger``'s swept option) and, with
    ``save``, stores the choice and the whole frontier (see ``frontier``) for this model; a choice
    from fewer than ``min_tokens`` tokens (default ``tokens_needed``) is refused (``check_evidence``)."""
    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    needed = tokens_needed(tolerance) if min_tokens is None else min_tokens
    if save and samples * steps < needed:  # refused before measuring anything
        raise ConfigError(f"calibrate: {samples} samples x {steps} steps = {samples * steps} tokens, but a stored choice "
                          f"needs at least {needed} (check_evidence); give more samples or steps, or min_tokens")
    measured = measure_taus(model, tokenizer, taus=taus, sample_ids=range(samples), length=length, steps=steps,
                            budget=budget, every_step=every_step, progress=progress, trigger=trigger,
                            options=options)
    points = measured.points()
    chosen = choose_for(measured, tolerance)
    if save:
        check_evidence(measured, tolerance, min_tokens)
        store(measured, chosen, tolerance)
    return chosen, points
