"""``kvpolicy calibrate``: choose the louiskv preset's trigger setting for a model once and store
it as the model's default (the calibration run is ``kvpolicy.eval.calibrate``; the store it writes
and ``preset(..., model=...)`` reads is ``kvpolicy.calibration``).

    kvpolicy calibrate --model smollm2 --samples 200
    kvpolicy calibrate --samples 50 --first-sample 50 --shard-out s1.json   # one shard of the work
    kvpolicy calibrate --merge s0.json s1.json ...                          # choose and store from shards
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..errors import ConfigError, KVPolicyError
from ..eval.defaults import (CALIBRATION_BUDGET, CALIBRATION_LENGTH, CALIBRATION_SAMPLES, CALIBRATION_STEPS,
                              CALIBRATION_TAUS, CALIBRATION_TOLERANCE)
from .common import add_plugin_flag, check_writable, csv, device_name


def add_parser(sub) -> None:
    cal = sub.add_parser("calibrate", help="choose the louiskv preset's trigger setting for a model once; stored as "
                                           "its default")
    cal.add_argument("--model", default="smollm2", help="as for `run`")
    cal.add_argument("--samples", type=int, default=CALIBRATION_SAMPLES,
                     help=f"local prompts to calibrate on (default {CALIBRATION_SAMPLES})")
    cal.add_argument("--length", type=int, default=CALIBRATION_LENGTH,
                     help=f"prompt length in tokens (default {CALIBRATION_LENGTH})")
    cal.add_argument("--steps", type=int, default=CALIBRATION_STEPS,
                     help=f"teacher-forced tokens per prompt (default {CALIBRATION_STEPS})")
    cal.add_argument("--trigger", choices=["score_gap", "query_cosine"], default="score_gap",
                     help="the trigger to calibrate: score_gap (the louiskv preset's; sweeps --margins) or "
                          "query_cosine (the paper's; sweeps --taus)")
    cal.add_argument("--margins", default="-1,-1.5,-2,-2.5,-3,-4",
                     help="score_gap margins to try (default -1,-1.5,-2,-2.5,-3,-4)")
    cal.add_argument("--measure", choices=["mass", "weakest"], default="mass",
                     help="score_gap's measure (default mass)")
    cal.add_argument("--leaving", choices=["unheld", "ignored"], default="ignored",
                     help="score_gap's tokens that left the window while the selection was kept: ignored (default, "
                          "the built-in louiskv setting) or counted as unheld")
    cal.add_argument("--estimate", choices=["mean", "outlier"], default="mean",
                     help="score_gap's estimate of a unit's attention mass: mean (its mean key; default) or outlier "
                          "(each prompt unit's --outliers keys farthest from its mean, one by one)")
    cal.add_argument("--outliers", type=int, default=None,
                     help="score_gap's outlier keys a prompt unit (with --estimate outlier; default 1)")
    cal.add_argument("--group", choices=["mean", "each"], default="mean",
                     help="score_gap's query: the query group's mean (default) or each query head's own")
    cal.add_argument("--taus", default=csv(CALIBRATION_TAUS), help="query_cosine taus to try")
    cal.add_argument("--budget", type=int, default=CALIBRATION_BUDGET)
    cal.add_argument("--min-tokens", type=int, default=None,
                     help="teacher-forced tokens (prompts x steps) a choice needs before it is stored (default: "
                          "enough that one token is at most a quarter of --tolerance, 200 at 2 points)")
    cal.add_argument("--tolerance", type=float, default=CALIBRATION_TOLERANCE,
                     help="keep the setting with the fewest re-selections whose top-1 agreement is within this of "
                          f"every-step selection's with the same units (default {CALIBRATION_TOLERANCE}: "
                          f"{100 * CALIBRATION_TOLERANCE:g} points)")
    cal.add_argument("--against", choices=["previous", "anchor"], default="previous",
                     help="the query_cosine trigger's reference query (default: the previous step's, as LouisKV)")
    cal.add_argument("--first-sample", type=int, default=0,
                     help="measure samples FIRST..FIRST+SAMPLES-1 (to split the work over processes)")
    cal.add_argument("--shard-out", metavar="FILE",
                     help="only measure, and write the per-sample figures to FILE (nothing is stored)")
    cal.add_argument("--merge", nargs="+", metavar="FILE",
                     help="choose and store from --shard-out files instead of measuring")
    cal.add_argument("--device", default=None)
    add_plugin_flag(cal)


def _print_points(measured, chosen: float, tolerance: float) -> None:
    from ..eval.calibrate import frontier_table

    print(frontier_table(measured, tolerance, chosen))


def _choose_and_store(measured, tolerance: float, min_tokens: int | None) -> float:
    from ..eval.calibrate import check_evidence, choose_for, store

    chosen = choose_for(measured, tolerance)
    _print_points(measured, chosen, tolerance)  # printed either way: the figures are not lost
    try:
        check_evidence(measured, tolerance, min_tokens)
    except ConfigError as error:
        raise KVPolicyError(f"not stored: {error}") from None
    store(measured, chosen, tolerance)
    return chosen


def main(args) -> int:
    from ..calibration import calibration_file
    from ..eval.calibrate import TauMeasurements, measure_taus, merge

    tolerance = args.tolerance
    if not 0.0 <= tolerance <= 1.0:
        raise KVPolicyError(f"--tolerance must be in [0, 1] (a share of top-1 agreement), got {tolerance}")
    if args.merge:
        shards = []
        for name in args.merge:
            try:
                shards.append(TauMeasurements(**json.loads(Path(name).read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError) as exc:
                raise KVPolicyError(f"--merge: cannot read calibration shard {name!r}: {exc}") from None
        measured = merge(shards)
        chosen = _choose_and_store(measured, tolerance, args.min_tokens)
        print(f"{len(measured.sample_ids)} samples; stored {measured.trigger} {measured.parameter}={chosen} for "
              f"{measured.model} in {calibration_file()}")
        return 0

    try:
        taus = [float(t) for t in args.taus.split(",") if t.strip()]
    except ValueError:
        raise KVPolicyError(f"--taus takes comma-separated numbers, got {args.taus!r}") from None
    if not taus or any(not -1.0 <= t <= 1.0 for t in taus):
        raise KVPolicyError(f"--taus must be numbers in [-1, 1], got {args.taus!r}")
    try:
        margins = [float(m) for m in args.margins.split(",") if m.strip()]
    except ValueError:
        raise KVPolicyError(f"--margins takes comma-separated numbers, got {args.margins!r}") from None
    if not margins or any(m != m for m in margins):
        raise KVPolicyError(f"--margins takes comma-separated numbers, got {args.margins!r}")
    if args.samples < 1 or args.steps < 2 or args.length < 64 or args.first_sample < 0:
        raise KVPolicyError("--samples must be >= 1, --steps >= 2, --length >= 64 and --first-sample >= 0")
    if args.trigger == "score_gap":
        from ..triggers.score_gap import ScoreGap

        try:  # a bad combination is refused before the model loads
            ScoreGap(measure=args.measure, leaving=args.leaving, estimate=args.estimate, group=args.group,
                     outliers=1 if args.outliers is None else args.outliers).validate()
        except ConfigError as error:
            raise KVPolicyError(f"calibrate: {error}") from None
    if args.budget >= args.length:
        raise KVPolicyError(f"--budget {args.budget} covers the whole {args.length}-token prompt: every tau would "
                            "attend to everything; use a longer --length or a smaller --budget")
    if args.against != "previous" and not args.shard_out:
        raise KVPolicyError("--against anchor is an experiment: use it with --shard-out (the louiskv preset's tau "
                            "is calibrated with the previous-query trigger)")
    check_writable(args.shard_out, "--shard-out")
    if not args.shard_out:  # what would be refused after the run is refused before it
        from ..eval.calibrate import tokens_needed

        needed = tokens_needed(tolerance) if args.min_tokens is None else args.min_tokens
        if args.samples * args.steps < needed:
            raise KVPolicyError(f"--samples {args.samples} x --steps {args.steps} = {args.samples * args.steps} tokens; "
                                f"a stored choice needs at least {needed} (one token at most a quarter of --tolerance): "
                                "give more --samples, or --min-tokens to accept fewer")
    device = device_name(args)
    from ..models import load_model

    model, tokenizer = load_model(args.model, device=device)
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        eta = (time.perf_counter() - started) / done * (total - done)
        print(f"\r[{done}/{total}] prompts, ETA {eta:.0f} s", end="" if done < total else "\n", flush=True)

    sample_ids = range(args.first_sample, args.first_sample + args.samples)
    if args.trigger == "score_gap":
        values, options = margins, {"measure": args.measure, "leaving": args.leaving}
        # named only when set, as the policy's spec names them: stored defaults stay as they were
        if args.estimate != "mean":
            options["estimate"] = args.estimate
        if args.outliers is not None:
            options["outliers"] = args.outliers
        if args.group != "mean":
            options["group"] = args.group
    else:
        values, options = taus, {}
    measured = measure_taus(model, tokenizer, taus=values, sample_ids=sample_ids, length=args.length,
                            steps=args.steps, budget=args.budget, against=args.against, progress=progress,
                            trigger=args.trigger, options=options)
    if args.shard_out:
        from dataclasses import asdict

        Path(args.shard_out).write_text(json.dumps(asdict(measured)), encoding="utf-8")
        _print_points(measured, float("nan"), tolerance)
        print(f"wrote the figures of {len(sample_ids)} samples to {args.shard_out}; merge shards with --merge")
        return 0
    chosen = _choose_and_store(measured, tolerance, args.min_tokens)
    print(f"stored {measured.trigger} {measured.parameter}={chosen} for this model in {calibration_file()}")
    return 0
