"""The grids of ``kvpolicy bench``: each benchmark run over its cells (contexts x batches x presets
x placements), one row per cell, yielded as it is measured.

A row is a JSON-ready dict: what ``kvpolicy bench ... --json`` writes. The CLI only prints them;
the Python API gets the same rows::

    from kvpolicy.bench import sweeps
    rows = list(sweeps.layer(cells=[("louiskv", ["cpu", "gpu"])], contexts=[131072], batches=[1],
                             budget=2048, backend="triton", device=device, rate=0.176, ...))

A cell that could not be measured yields a row with an ``"error"`` (and, for a failure other than
running out of GPU memory, ``"failed": True`` and its ``"traceback"``), so one broken cell never
hides the others' figures; the CLI prints such rows and leaves them out of its JSON.

``PresetCells`` is ``--presets`` read with each preset's placements: ``[("louiskv", ["cpu",
"gpu"]), ("arkvale", ["cpu"])]``.
"""

from __future__ import annotations

import traceback
from typing import Iterable, Iterator

import torch

PresetCells = list[tuple[str, list[str]]]
FULL_KINDS = ("full-graph", "full-sdpa-graph", "full-eager")


def louiskv_interval(rate: float) -> int:
    """The ``interval(n)`` that stands in for LouisKV's trigger at re-selection share ``rate``
    (random weights have no query dynamics): the longest whose share ``1 / n`` is at least
    ``rate``, so a row never re-selects less often than the measured rate (17.6%: interval(5))."""
    return max(1, int(1 / rate))


def whole_intervals(steps: int, every: int) -> int:
    """``steps`` rounded up to whole intervals: interval(n) re-selects once in any n consecutive
    steps, so a row timed over whole intervals holds exactly the rate it names (10 steps of
    interval(9) hold one re-selection: 10%, not 11.1%)."""
    return every * -(-steps // every)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def e2e(model, *, contexts: Iterable[int], batches: Iterable[int], cells: PresetCells, budget: int, steps: int,
        backend: str, full_kinds: Iterable[str], branch_kinds: list[str], rate: float,
        unit_cache_rows: int | None = None, stickiness: Iterable[float] = (0.0,),
        pulls: Iterable[float] = (0.0,)) -> Iterator[dict]:
    """Decode ms per step of whole-model steps: full-graph (the baseline every ratio is against),
    ``budget-floor`` (full-graph at the budget's context: the best any policy can do on the
    stack), the other ``full_kinds``, then each preset at each placement and DecodeGraph branch
    kind; louiskv at ``interval(n)`` (``rate``), never re-selecting after its first step
    (``/reuse``; ``/score_gap_reuse``: the preset's SmolLM2 trigger, score_gap, reusing;
    ``/score_gap_exact_reuse``: the same with exact products, not its query in fixed point;
    ``/score_gap_every2_reuse``: the same measuring at one step in two;
    ``/score_gap_every4_challengers8_reuse``: the whole table at one step in four, 8 challengers) and at
    every step (``/every_step``); ``unit_cache_rows``: the policies' GPU unit cache
    (``Policy.unit_cache_rows``). A policy row carries its ``miss_fraction``. ``stickiness``:
    louiskv's re-selecting rows run once per value, with unit scores biased by up to that much
    per unit (``overlap.StickyTopBudget``: selections overlap as a real model's do), labelled
    ``~sN`` unless the only value is 0; ``pulls``: pariskv's rows the same way, with its selection's query
    pulled by that many times its norm (``overlap.StickyCollisionRerank``), labelled ``~pN``."""
    from ..presets import BUILTIN_TRIGGER, EMBEDDED_ID, preset
    from .e2e import DoesNotFit, full_throughput, policy_throughput
    from .overlap import StickyCollisionRerank, StickyTopBudget

    device = next(model.parameters()).device
    emulate = device.type != "cuda"
    every = louiskv_interval(rate)
    interval_steps = whole_intervals(steps, every)
    stickiness = list(stickiness)
    labelled = stickiness != [0.0]
    tags = [(f"~s{bias:g}" if labelled else "", bias) for bias in stickiness]
    louiskv_triggers = ([("interval" + tag, {"name": "interval", "n": every}, bias) for tag, bias in tags]
                        + [("reuse", {"name": "interval", "n": 1 << 40}, 0.0)]  # never re-selects: no bias to try
                        # the preset's trigger for SmolLM2 (score_gap) at a margin it never passes:
                        # its step cost, reusing
                        + [("score_gap_reuse", {**BUILTIN_TRIGGER[EMBEDDED_ID], "margin": 1e9}, 0.0)]
                        # the same with exact products (the preset's query is in fixed point since session 35:
                        # ``ScoreGap.fixed_query``)
                        + [("score_gap_exact_reuse", {**BUILTIN_TRIGGER[EMBEDDED_ID], "margin": 1e9,
                                                      "fixed_query": False}, 0.0)]
                        # the same measuring the gap at one step in two (``every``: half its bytes a step)
                        + [("score_gap_every2_reuse", {**BUILTIN_TRIGGER[EMBEDDED_ID], "margin": 1e9, "every": 2},
                            0.0)]
                        # one step in four reads the whole table, the others the held units and 8 challengers
                        # a query head (a selection kept throughout, so none goes stale: its cheapest case)
                        + [("score_gap_every4_challengers8_reuse",
                            {**BUILTIN_TRIGGER[EMBEDDED_ID], "margin": 1e9, "every": 4, "challengers": 8}, 0.0)]
                        + [("every_step" + tag, {"name": "every_step"}, bias) for tag, bias in tags])
    pulls = list(pulls)
    pariskv_rows = [(f"~p{pull:g}" if pulls != [0.0] else None, None, pull) for pull in pulls]
    full_kinds = list(full_kinds)
    for context in contexts:
        for batch in batches:
            base = floor = None
            grid = [("full-graph", None, None, steps), ("budget-floor", None, None, steps)]
            grid += [(kind, None, None, steps) for kind in full_kinds if kind != "full-graph"]
            for name, placements in cells:
                for placement in placements:
                    triggers = {"louiskv": louiskv_triggers, "pariskv": pariskv_rows}.get(name, [(None, None, 0.0)])
                    for tag, trigger, bias in triggers:
                        options = {"budget": budget, "placement": placement, "backend": backend,
                                   "unit_cache_rows": unit_cache_rows}
                        if trigger:
                            options["trigger"] = trigger
                        if bias and name == "pariskv":
                            options["selector"] = StickyCollisionRerank.pulling(preset(name, **options).selector, bias)
                        elif bias:
                            options["selector"] = StickyTopBudget(stickiness=bias)
                        label = f"{name}/{placement}" + (f"/{tag}" if tag else "")
                        for kind in branch_kinds:
                            shown = label + (f"[{kind}]" if len(branch_kinds) > 1 else "")
                            cell_steps = interval_steps if tag and tag.startswith("interval") else steps
                            grid.append((shown, preset(name, **options), kind, cell_steps))
            for label, policy, branches, cell_steps in grid:
                try:
                    if label == "budget-floor":
                        r = full_throughput(model, "full-graph", batch, budget, steps, backend=backend)
                        r.kind = label
                    elif policy is None:
                        r = full_throughput(model, label, batch, context, steps, backend=backend)
                    else:
                        r = policy_throughput(model, policy, batch, context, cell_steps, emulate=emulate,
                                              branches=branches)
                except DoesNotFit as error:  # counted before allocating: the row says what does not fit
                    yield {"kind": label, "batch": batch, "context": context, "error": str(error)}
                    continue
                except torch.cuda.OutOfMemoryError as error:  # the allocator's first line: what it tried to take
                    what = str(error).splitlines()[0] if str(error) else ""
                    out_of_memory = {"kind": label, "batch": batch, "context": context,
                                     "error": f"out of GPU memory: {what}", "traceback": traceback.format_exc()}
                except Exception as error:  # one broken cell must not hide the others' figures
                    yield {"kind": label, "batch": batch, "context": context, "failed": True,
                           "error": f"FAILED: {type(error).__name__}: {error}", "traceback": traceback.format_exc()}
                    continue
                else:
                    out_of_memory = None
                if out_of_memory:  # yielded out of the handler, whose frames held the cell's tensors
                    torch.cuda.empty_cache()
                    yield out_of_memory
                    continue
                base = r.ms_per_step if label == "full-graph" else base
                floor = r.ms_per_step if label == "budget-floor" else floor
                over = r.ms_per_step - floor if floor and policy is not None else None
                yield {**r.__dict__, "kind": label, "branches": branches, "tokens_per_s": r.tokens_per_s,
                       "speedup_vs_full_graph": base / r.ms_per_step if base else None,
                       "budget_floor_ms": floor, "over_floor_ms": over}
                _release(device)


def ttft(model, *, lengths: Iterable[int], batches: Iterable[int], cells: PresetCells, budget: int, backend: str,
         repeats: int) -> Iterator[dict]:
    """Time to first token of full attention, then of each preset at each placement, per batch
    and prompt length; ``vs_full`` is the ratio to full attention's."""
    from ..presets import preset
    from .ttft import time_first_token

    lengths = list(lengths)
    for batch in batches:
        for length in lengths:
            full = None
            for name, placements in [("full", [None])] + [c for c in cells if c[0] != "full"]:
                for placement in placements:
                    options = {} if name == "full" else {"budget": budget, "placement": placement, "backend": backend}
                    r = time_first_token(model, preset(name, **options), batch, length, repeats=max(1, repeats))
                    full = r.ttft_ms if name == "full" else full
                    yield {**r.__dict__, "vs_full": r.ttft_ms / full}


def gather(device: torch.device, *, batches: Iterable[int], runs: Iterable[int], rows: int, backend: str,
           repeats: int, ops: Iterable[str] = ("gather", "refresh"), replay: bool = False,
           resident: Iterable[float] = (0.0,)) -> Iterator[dict]:
    """On a GPU first the pinned allocation's cost (a row ``{"pinned_allocation": ...}``), then the
    pool gather's bandwidth against a pinned copy, per batch, run length and op (of ``gather.OPS``),
    each call timed as a graph replay where ``replay``; ``refresh`` once per ``resident`` share (rows
    already in the buffer)."""
    from .gather import measure_gather, measure_pinned_allocation

    if device.type == "cuda":
        yield {"pinned_allocation": measure_pinned_allocation(device).__dict__}
    runs, ops, resident = list(runs), list(ops), list(resident)
    for batch in batches:
        for run in runs:
            for op in ops:
                for share in resident if op == "refresh" else [0.0]:
                    r = measure_gather(device, backend=backend, batch=batch, rows=rows, repeats=repeats, run=run,
                                       op=op, replay=replay, resident=share)
                    yield {**r.__dict__, "ratio": r.ratio}


def layer(device: torch.device, *, contexts: Iterable[int], batches: Iterable[int], cells: PresetCells, budget: int,
          backend: str, rate: float, random_units: bool, repeats: int, replay: bool,
          decode_steps: int) -> Iterator[dict]:
    """One decode layer's time split per preset and placement (full attention's beside the first
    of each batch); louiskv's amortised column at ``rate``, the others' at 1."""
    from .layer import LayerShape, layer_policy, time_layer

    batches = list(batches)
    for context in contexts:
        for batch in batches:
            first = True
            for name, placements in cells:
                share = rate if name == "louiskv" else 1.0
                for placement in placements:
                    policy = layer_policy(name, budget, placement, backend, random_units)
                    t = time_layer(policy, LayerShape(batch=batch, context=context), device, repeats=repeats,
                                   with_full=first, replay=replay, decode_steps=decode_steps)
                    first = False
                    yield t.as_dict(share)
                    _release(device)
