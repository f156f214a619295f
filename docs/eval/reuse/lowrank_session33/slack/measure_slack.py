"""A third low-rank scheme for the outlier score-gap trigger: approximate with a slack threshold (issue 12).

Open loop, as ``../measure_lowrank.py`` (the full trigger decides; the scheme is computed beside it). Per
(layer, step, KV head, query head) the firing threshold is ``T = held log mass + margin`` (the held units
scored whole, exactly, as today). Every unheld unit whose rank-r approximate log mass (the study's top-k
approximation: the query projected on the basis, int8 coordinates, no residual term) is ``>= T - delta`` is a
candidate; the union of candidates over the KV head's query heads is read whole and estimated exactly for every
query head; the scheme fires where any of those exact estimates exceeds ``T`` (the gap over the margin, as the
trigger computes it). ``per-head`` variant (beside): a unit is estimated exactly only for the query heads where
it is a candidate.

The functions (bases, int8 projection, ``unit_terms``) are the study's, taken by executing
``measure_lowrank.py`` up to the point where it patches ``reference_step`` and runs the eval (importing it would
run its eval). Only the ``pca`` and ``chan`` bases, ranks ``KVPOLICY_LR33_RANKS`` (8,16,32), no ``bits``.

Recorded per (basis, r, delta): missed and extra fires (counted directly), a histogram of candidates a
(layer, step, KV head) row (union over query heads); per full fire (layer, step, sequence) and basis:r, the
delta it needs to be caught (union and per-head), the full gap over the margin, and (approx - exact) at the
firing pair of largest exact estimate over T and at the firing pair closest to being a candidate.

    KVPOLICY_SLACK_OUT=stats.json python measure_slack.py eval --device cpu --model smollm2 ...
"""
import json
import os
import sys
import time
from pathlib import Path

import torch

import kvpolicy
import kvpolicy.kernels.reference_step as rs

STUDY = Path(os.environ.get("KVPOLICY_SLACK_STUDY") or Path(kvpolicy.__file__).resolve().parents[1]
             / "docs/eval/reuse/lowrank_session33/measure_lowrank.py")
src = STUDY.read_text()
cut = src.index("rs.outlier_log_mass = capturing_mass")
ns = {"__name__": "measure_lowrank_defs", "__file__": str(STUDY)}
exec(compile(src[:cut], str(STUDY), "exec"), ns)
ns["BASES"] = ("pca", "chan")
ns["BITS"] = ()

DELTAS = tuple(float(d) for d in os.environ.get("KVPOLICY_SLACK_DELTAS", "0,1,2,3,4,6,8").split(","))
INF = float("inf")
seen = ns["seen"]
orig_opened = ns["orig_opened"]

stats = {
    "study": str(STUDY), "deltas": DELTAS, "layer_steps": 0, "no_selection_steps": 0, "full_fires": 0,
    "rows": 0, "held_units": 0, "prompt_units": [], "decode_units": [], "dim": None, "group": None,
    "kv_heads": None,
    "slack": {},  # basis:r:delta -> missed, extra, missed_per_head, extra_per_head, cand_hist {n: rows}, cand_pairs
    "fires": {},  # basis:r -> list of [needed_union, needed_per_head, gap_over_margin, err_best, err_closest]
}


def r3(x):
    return None if x == INF else round(float(x), 3)


def measuring_opened(trigger, state, log_mass, held):
    log_mass = orig_opened(trigger, state, log_mass, held)
    outliers, units, query, scale = seen["outliers"], seen["units"], seen["query"], seen["scale"]
    if not seen["each"]:
        raise SystemExit("measure_slack: expects group='each'")
    stats["layer_steps"] += 1
    if getattr(state, "_lr33_query", None) is None or getattr(state, "_lr33_query_of", None) is not outliers:
        state._lr33_query = query.float().view(*log_mass.shape[:3], query.shape[-1]).clone()
        state._lr33_query_of = outliers
    if not bool(state.has_selection.all()):
        stats["no_selection_steps"] += 1
        return log_mass
    batch, heads, per_head, count = log_mass.shape
    group = query.float().view(batch, heads, per_head, query.shape[-1])
    stats.update(dim=query.shape[-1], group=per_head, kv_heads=heads)
    cache = ns["layer_cache"](state, outliers, units)
    stats["prompt_units"].append(units.num_prompt_units)
    stats["decode_units"].append(count - units.num_prompt_units)
    finite = log_mass > -INF
    held_ok = held & finite
    stats["held_units"] += int(held_ok[:, :, 0].sum())
    held_mass = torch.logsumexp(log_mass.masked_fill(~held_ok, -INF), -1)  # (B, H, G)
    margin = trigger.margin_of(state.layer.layer_idx)
    threshold = held_mass + margin
    candidate = finite & ~held
    over = (log_mass - held_mass[..., None]).masked_fill(~candidate, -INF)  # exact gap of each pair
    best = over.amax(-1)  # (B, H, G)
    full_gap = best.flatten(1).amax(-1)  # (B,)
    full_fire = full_gap > margin
    firing = over > margin  # (B, H, G, U): the pairs that make the full trigger fire
    stats["full_fires"] += int(full_fire.sum())
    stats["rows"] += batch * heads
    keymean = units.key_mean.float()
    for (name, r), (P, mu) in cache["bases"].items():
        oproj, rproj = cache["proj"][(name, r, True)]
        dproj = ns["project"](keymean, P, mu, 1, True)
        approx = ns["unit_terms"](group, scale, P, mu, oproj, rproj, dproj, outliers, units, False)
        need = (threshold[..., None] - approx).masked_fill(~candidate, INF)  # candidate at delta iff need <= delta
        need_unit = need.amin(2)  # (B, H, U): a candidate for some query head of the KV head
        for delta in DELTAS:
            union = need_unit <= delta  # (B, H, U)
            scored = over.masked_fill(~union.unsqueeze(2), -INF).amax(-1)
            fire = scored.flatten(1).amax(-1) > margin
            ph = need <= delta
            fire_ph = over.masked_fill(~ph, -INF).amax(-1).flatten(1).amax(-1) > margin
            s = stats["slack"].setdefault(f"{name}:{r}:{delta:g}", {
                "missed": 0, "extra": 0, "missed_per_head": 0, "extra_per_head": 0, "cand_hist": {},
                "cand_pairs": 0})
            s["missed"] += int((full_fire & ~fire).sum())
            s["extra"] += int((fire & ~full_fire).sum())
            s["missed_per_head"] += int((full_fire & ~fire_ph).sum())
            s["extra_per_head"] += int((fire_ph & ~full_fire).sum())
            s["cand_pairs"] += int(ph.sum())
            for n in union.sum(-1).flatten().tolist():
                s["cand_hist"][n] = s["cand_hist"].get(n, 0) + 1
        if bool(full_fire.any()):
            fire_unit = firing.any(2)  # (B, H, U)
            needed_union = need_unit.masked_fill(~fire_unit, INF).flatten(1).amin(-1)
            need_firing = need.masked_fill(~firing, INF).flatten(1)
            needed_ph, closest = need_firing.min(-1)
            err = (approx - log_mass).flatten(1)  # approx - exact
            best_pair = over.flatten(1).argmax(-1)
            for b in full_fire.nonzero().flatten().tolist():
                stats["fires"].setdefault(f"{name}:{r}", []).append([
                    r3(needed_union[b]), r3(needed_ph[b]), r3(full_gap[b] - margin),
                    r3(err[b, best_pair[b]]), r3(err[b, closest[b]])])
    return log_mass


rs.outlier_log_mass = ns["capturing_mass"]
rs._without_opened_units = measuring_opened
from kvpolicy.cli import main  # noqa: E402

began = time.time()
try:
    main(sys.argv[1:])
except SystemExit as e:
    if e.code not in (None, 0):
        raise
stats["seconds"] = time.time() - began
stats["energy"] = ns["stats"]["energy"]
stats["kvpolicy"] = kvpolicy.__file__
out = os.environ.get("KVPOLICY_SLACK_OUT", "slack_stats.json")
with open(out, "w") as f:
    json.dump(stats, f)
print(f"wrote {out}: {stats['layer_steps']} layer steps, {stats['full_fires']} full fires, {stats['seconds']:.0f} s")
