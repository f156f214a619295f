"""Could a low-rank first pass over the unit table decide as the outlier score-gap trigger does? (issue 12)

Wraps ``reference_step``'s outlier trigger during one eval run (CPU, reference kernels; as session 31's
``bounds_session31/measure_bounds.py``) and, at each (layer, step) the trigger runs with a selection, measures
two schemes against the full estimate (``outlier_log_mass``) for each of several bases of ``r`` directions a
(layer, KV head), taken once from that head's prompt keys (the keys of its prompt units, read from the pool
through the table's ``order``, at the layer's first step):

* ``pca``: the top ``r`` eigenvectors of the keys' uncentred second moment;
* ``pcac``: the top ``r`` of their covariance, about the keys' mean ``mu`` (``q . mu`` is computed exactly);
* ``chan``: the ``r`` channels of largest key energy (sum of squares);
* ``qchan`` (beyond the brief): the ``r`` channels of largest key energy times the energy of the layer's
  first decode query (its query heads' squares summed; the step that makes the first selection), i.e. of
  the largest expected ``(q_d k_d)^2``.

Every stored vector ``k`` the trigger scores (each prompt unit's outlier keys, as int8 times their scale; its
rest mean, likewise; each unit's float16 ``key_mean``, used for decode units) keeps ``c = P^T (k - mu)`` and
``e = ||(k - mu) - P c||``. Stored ``int8`` (the default, ``--exact-coords`` off): ``c`` as int8 multiples of a
scale per unit (the outlier keys of a unit share one, the rest mean its own, a decode mean its own) and ``e``
in float16 rounded up.

1. Exact filter (Cauchy-Schwarz): ``q . k <= q . mu + (P^T q) . c_hat + ||P^T q||_1 * s / 2 + ||q_perp|| * e``
   (``s / 2``: the rounding of ``c``; 0 for float coordinates), so an upper bound on each unit's log mass (its
   outliers' and rest's bounds through the same logsumexp; a decode unit's plus log size). Counted: the
   (query head, unit) candidate pairs (unheld, finite) whose bound reaches the firing threshold (the held
   units' exact log mass plus the layer's margin), the (layer, step, KV head) rows with any, the units an
   exact pass would then read (the union over the KV head's query heads), and violations (a bound under the
   exact estimate by more than 1e-4; ``strict``: by any amount).
2. Approximate top-k then exact: each candidate's rank-r log mass (no residual term, int8 coordinates), the top
   ``k`` per query head, the union over the KV head's query heads scored exactly; fire where the best exact
   log mass among them over the held units' exact mass exceeds the margin in any query head. Compared with the
   full trigger's decision at each (layer, step): missed and extra fires.

Beyond the brief, the same two schemes with every dimension kept at ``b`` bits (``bits``: ``b`` in 1-4; int
multiples of a scale per unit as today's int8 keys, 1 bit as the sign times the vector's mean magnitude), the
bound being ``q . k_hat + ||q|| * ||k - k_hat||`` (the residual norm in float16, rounded up).

Steps with no selection yet (which fire whatever the gap) are counted apart and left out.

    KVPOLICY_LR33_OUT=stats.json python measure_lowrank.py eval --device cpu --model smollm2 ...

``KVPOLICY_LR33_CLOSED=basis:r:k`` (e.g. ``pcac:16:8``) also makes that top-k scheme decide the run (the
unheld units outside the scored union are dropped from the trigger's estimate), so the answers show what its
misses cost.
"""
import json
import os
import sys
import time

import torch

import kvpolicy.kernels.reference_step as rs

RANKS = tuple(int(r) for r in os.environ.get("KVPOLICY_LR33_RANKS", "8,16,32").split(","))
BASES = tuple(os.environ.get("KVPOLICY_LR33_BASES", "pca,pcac,chan,qchan").split(","))  # Gemma 3 run: pca,chan
KS = tuple(int(k) for k in os.environ.get("KVPOLICY_LR33_KS", "4,8,16,32").split(","))
BITS = tuple(int(b) for b in os.environ.get("KVPOLICY_LR33_BITS", "1,2,3,4").split(",") if b)
TOL = 1e-4
CLOSED = os.environ.get("KVPOLICY_LR33_CLOSED") or None
# Gemma 3 run: also count, at each measured step, the decisions the trigger and each top-k would make at these
# other margins (SmolLM2's -0.5 among them); the run itself stays decided at the preset's margin
MARGINS = tuple(float(m) for m in os.environ.get("KVPOLICY_LR33_MARGINS", "-0.5,0.0").split(",") if m)
if CLOSED:
    CLOSED = tuple(CLOSED.split(":"))

seen = {}
orig_mass, orig_opened = rs.outlier_log_mass, rs._without_opened_units
stats = {
    "layer_steps": 0, "no_selection_steps": 0, "exact_reach_pairs": 0, "exact_reach_rows": 0,
    "exact_reach_units": 0, "full_fires": 0, "rows": 0, "pairs": 0,
    "prompt_units": [], "decode_units": [], "held_units": 0, "dim": None, "group": None, "kv_heads": None,
    "energy": {},  # basis:r -> [captured key energy share summed, count]
    "filter": {},  # basis:r:coords -> counters
    "topk": {},  # basis:r:k -> counters
    "missed_gaps": {},
    "approx": {},  # basis:r -> mean |approx - exact| log mass, and the exact best unit's approximate rank  # basis:r:k -> list of (full gap - margin) at missed fires
    "full_gap_minus_margin": [],
    "full_fires_at": {},  # margin -> full trigger's fires had it used that margin
    "topk_missed_at": {},  # basis:r:k -> margin -> missed fires at that margin
}


def capturing_mass(outliers, units, query, scale, each):
    seen.update(outliers=outliers, units=units, query=query, scale=scale, each=each)
    return orig_mass(outliers, units, query, scale, each)


def prompt_keys(state, b, h, rows):
    """``(n, D)`` float32: the keys of head ``h``'s prompt units (sequence ``b``), from the pool (``rows``:
    ``(B, H, n_max)``, the pool rows of the table's ``order`` positions)."""
    units, store = state.layer.units, state.layer.store
    prompt = units.num_prompt_units
    end = int((units.start[b, h, :prompt] + units.size[b, h, :prompt]).max())
    return store.pool.keys[b, h].index_select(0, rows[b, h, :end].long()).float()


def make_bases(state, first_query):
    """Per basis name and rank: ``(P (B, H, D, r), mu (B, H, D))``, and the captured energy shares."""
    keys0 = state.layer.store.pool.keys
    batch, heads, _, dim = keys0.shape
    out = {}
    for name in BASES:
        for r in RANKS:
            out[(name, r)] = (torch.zeros(batch, heads, dim, r), torch.zeros(batch, heads, dim))
    units = state.layer.units
    prompt = units.num_prompt_units
    end = int((units.start[..., :prompt] + units.size[..., :prompt]).max())
    rows = state.layer.store.pool_rows(units.order[..., :end].contiguous())
    for b in range(batch):
        for h in range(heads):
            k = prompt_keys(state, b, h, rows)
            second = k.T @ k / k.shape[0]
            mu = k.mean(0)
            cov = second - torch.outer(mu, mu)
            total = float((k * k).sum(-1).mean())
            for name in BASES:
                if name in ("chan", "qchan"):
                    weight = torch.diagonal(second)
                    if name == "qchan":
                        weight = weight * (first_query[b, h] ** 2).sum(0)
                    order = weight.argsort(descending=True)
                    vecs = torch.eye(dim)[:, order]
                    centre = torch.zeros(dim)
                    vals = torch.diagonal(second)[order]
                else:
                    mat = second if name == "pca" else cov
                    vals, vecs = torch.linalg.eigh(mat.double())
                    vals, vecs = vals.flip(0).float(), vecs.flip(1).float()
                    centre = torch.zeros(dim) if name == "pca" else mu
                for r in RANKS:
                    P, muo = out[(name, r)]
                    P[b, h] = vecs[:, :r]
                    muo[b, h] = centre
                    captured = float(vals[:r].sum()) + (float(mu @ mu) if name == "pcac" else 0.0)
                    e = stats["energy"].setdefault(f"{name}:{r}", [0.0, 0])
                    e[0] += captured / total
                    e[1] += 1
    return out


def fp16_up(x):
    """``x`` (float32, >= 0) as float16 values rounded up (still float32)."""
    h = x.half().float()
    up = torch.nextafter(x.half(), torch.full_like(x.half(), float("inf"))).float()
    return torch.where(h < x, up, h)


def project(vectors, P, mu, unit_dims, quantize):
    """``vectors (B, H, U, [m,] D)``: coordinates ``(..., r)`` (int8-rounded multiples of a scale per unit
    when ``quantize``), the rounding's half step ``(B, H, U)`` and the residual norms ``(..., )`` (fp16, up)."""
    extra = vectors.dim() - 4
    shape = (*P.shape[:2], *([1] * (1 + extra)), *P.shape[2:])
    Pv = P.view(shape)
    centred = vectors - mu.view(*mu.shape[:2], *([1] * (1 + extra)), mu.shape[-1])
    c = (centred.unsqueeze(-1) * Pv).sum(-2)  # (..., r)
    resid = (centred - (Pv * c.unsqueeze(-2)).sum(-1)).norm(dim=-1)
    if quantize:
        dims = tuple(range(-unit_dims, 0))
        step = c.abs().amax(dim=dims) / 127.0  # (B, H, U)
        div = step.clamp(min=1e-30).view(*step.shape, *([1] * unit_dims))
        c = torch.round(c / div).clamp(-127, 127) * div
        half = step / 2
    else:
        half = torch.zeros(c.shape[:3])
    return c, half, fp16_up(resid)


def quant_bits(vectors, unit_dims, bits):
    """``vectors (B, H, U, [m,] D)`` at ``bits`` bits a dimension: the values ``k_hat`` and ``||k - k_hat||``
    (float16, rounded up)."""
    if bits == 1:
        step = vectors.abs().mean(-1, keepdim=True)
        hat = torch.sign(vectors) * step
    else:
        top = 2 ** (bits - 1) - 1
        dims = tuple(range(-unit_dims - 1, 0))
        step = (vectors.abs().amax(dim=dims, keepdim=True) / top).clamp(min=1e-30)
        hat = torch.round(vectors / step).clamp(-top, top) * step
    return hat, fp16_up((vectors - hat).norm(dim=-1))


def bits_terms(group, scale, oq, rq, dq, outliers, units, bound):
    """``(B, H, G, U)``: each unit's log mass from ``bits``-bit vectors, an upper bound or the approximation."""
    qn = group.norm(dim=-1)  # (B, H, G)
    dec = torch.einsum("bhgd,bhud->bhgu", group, dq[0])
    if bound:
        dec = dec + qn[..., None] * dq[1][:, :, None]
    dec = dec * scale + torch.log(units.size.clamp(min=1).float()).unsqueeze(2)
    prompt = outliers.rest_count.shape[-1]
    if prompt:
        out = torch.einsum("bhgd,bhumd->bhgum", group, oq[0])
        rest = torch.einsum("bhgd,bhud->bhgu", group, rq[0])
        if bound:
            out = out + qn[..., None, None] * oq[1][:, :, None]
            rest = rest + qn[..., None] * rq[1][:, :, None]
        out = (out * scale).masked_fill(~outliers.valid.unsqueeze(2), float("-inf"))
        rest = rest * scale + torch.log(outliers.rest_count).unsqueeze(2)
        dec = dec.clone()
        dec[..., :prompt] = torch.logsumexp(torch.cat([out, rest.unsqueeze(-1)], dim=-1), dim=-1)
    return dec


def layer_cache(state, outliers, units):
    """Per (basis, r, quantize): the prompt vectors' projections (cached on the state: the prompt's keys do
    not change)."""
    cache = getattr(state, "_lr33", None)
    if cache is not None and cache["outliers"] is outliers:
        return cache
    bases = make_bases(state, state._lr33_query)
    okeys = outliers.keys.float() * outliers.key_scale[..., None, None]
    rest = outliers.rest_mean.float() * outliers.rest_scale[..., None]
    proj = {}
    for (name, r), (P, mu) in bases.items():
        for quantize in (False, True):
            proj[(name, r, quantize)] = (project(okeys, P, mu, 2, quantize), project(rest, P, mu, 1, quantize))
    for bits in BITS:
        proj[("bits", bits)] = (quant_bits(okeys, 2, bits), quant_bits(rest, 1, bits))
    cache = {"outliers": outliers, "bases": bases, "proj": proj}
    state._lr33 = cache
    return cache


def unit_terms(group, scale, P, mu, oproj, rproj, dproj, outliers, units, bound):
    """``(B, H, G, U)``: each unit's rank-r log mass, an upper bound (``bound``) or the approximation."""
    Pq = torch.einsum("bhgd,bhdr->bhgr", group, P)
    qmu = torch.einsum("bhgd,bhd->bhg", group, mu)
    qperp = (group - torch.einsum("bhgr,bhdr->bhgd", Pq, P)).norm(dim=-1)  # (B, H, G)
    l1 = Pq.abs().sum(-1)  # (B, H, G)

    def logits(proj, extra):  # proj: (c (B,H,U,[m,]r), half (B,H,U), resid (B,H,U,[m]))
        c, half, resid = proj
        if extra:
            val = torch.einsum("bhgr,bhumr->bhgum", Pq, c) + qmu[..., None, None]
            if bound:
                val = val + l1[..., None, None] * half[:, :, None, :, None] + qperp[..., None, None] * resid[:, :, None]
        else:
            val = torch.einsum("bhgr,bhur->bhgu", Pq, c) + qmu[..., None]
            if bound:
                val = val + l1[..., None] * half[:, :, None] + qperp[..., None] * resid[:, :, None]
        return val * scale

    dec = logits(dproj, False) + torch.log(units.size.clamp(min=1).float()).unsqueeze(2)
    prompt = outliers.rest_count.shape[-1]
    if prompt:
        out = logits(oproj, True).masked_fill(~outliers.valid.unsqueeze(2), float("-inf"))
        rest = logits(rproj, False) + torch.log(outliers.rest_count).unsqueeze(2)
        dec = dec.clone()
        dec[..., :prompt] = torch.logsumexp(torch.cat([out, rest.unsqueeze(-1)], dim=-1), dim=-1)
    return dec


def measuring_opened(trigger, state, log_mass, held):
    log_mass = orig_opened(trigger, state, log_mass, held)
    outliers, units, query, scale = seen["outliers"], seen["units"], seen["query"], seen["scale"]
    if not seen["each"]:
        raise SystemExit("measure_lowrank: expects group='each'")
    stats["layer_steps"] += 1
    if getattr(state, "_lr33_query", None) is None or getattr(state, "_lr33_query_of", None) is not outliers:
        # the layer's first query (this sample's): what ``qchan`` weights the channels by
        state._lr33_query = query.float().view(*log_mass.shape[:3], query.shape[-1]).clone()
        state._lr33_query_of = outliers
    if not bool(state.has_selection.all()):
        stats["no_selection_steps"] += 1
        return log_mass
    batch, heads, per_head, count = log_mass.shape
    group = query.float().view(batch, heads, per_head, query.shape[-1])
    stats.update(dim=query.shape[-1], group=per_head, kv_heads=heads)
    cache = layer_cache(state, outliers, units)
    prompt = units.num_prompt_units
    stats["prompt_units"].append(prompt)
    stats["decode_units"].append(count - prompt)
    finite = log_mass > float("-inf")
    held_ok = held & finite
    stats["held_units"] += int(held_ok[:, :, 0].sum())
    held_mass = torch.logsumexp(log_mass.masked_fill(~held_ok, float("-inf")), -1)  # (B, H, G)
    margin = trigger.margin_of(state.layer.layer_idx)
    threshold = held_mass + margin
    candidate = finite & ~held
    best = log_mass.masked_fill(~candidate, float("-inf")).amax(-1)
    full_gap = (best - held_mass).flatten(1).amax(-1)  # (B,)
    full_fire = full_gap > margin
    stats["full_fires"] += int(full_fire.sum())
    for m in MARGINS:
        stats["full_fires_at"][str(m)] = stats["full_fires_at"].get(str(m), 0) + int((full_gap > m).sum())
    stats["full_gap_minus_margin"].append(float((full_gap - margin).max()))
    stats["rows"] += batch * heads
    stats["pairs"] += int(candidate.sum())
    exact_reach = candidate & (log_mass >= threshold[..., None])
    stats["exact_reach_pairs"] += int(exact_reach.sum())
    stats["exact_reach_rows"] += int(exact_reach.any(-1).any(-1).sum())
    stats["exact_reach_units"] += int(exact_reach.any(2).sum())
    keymean = units.key_mean.float()
    closed_union = None
    variants = []
    for (name, r), (P, mu) in cache["bases"].items():
        for quantize in (False, True):
            oproj, rproj = cache["proj"][(name, r, quantize)]
            dproj = project(keymean, P, mu, 1, quantize)
            ub = unit_terms(group, scale, P, mu, oproj, rproj, dproj, outliers, units, True)
            approx = unit_terms(group, scale, P, mu, oproj, rproj, dproj, outliers, units, False) if quantize else None
            variants.append((f"{name}:{r}", "int8" if quantize else "float", ub, approx))
    for bits in BITS:
        oq, rq = cache["proj"][("bits", bits)]
        dq = quant_bits(keymean, 1, bits)
        ub = bits_terms(group, scale, oq, rq, dq, outliers, units, True)
        approx = bits_terms(group, scale, oq, rq, dq, outliers, units, False)
        variants.append((f"bits:{bits}", f"{bits}bit", ub, approx))
    for label, coords, ub, approx in variants:
        reach = candidate & (ub >= threshold[..., None])
        s = stats["filter"].setdefault(f"{label}:{coords}", {
            "reach_pairs": 0, "rows_reached": 0, "layer_steps_reached": 0, "exact_units": 0,
            "violations": 0, "strict_violations": 0, "max_under": 0.0, "mean_slack": [0.0, 0]})
        s["reach_pairs"] += int(reach.sum())
        s["rows_reached"] += int(reach.any(-1).any(-1).sum())
        s["layer_steps_reached"] += int(reach.flatten(1).any(-1).sum())
        s["exact_units"] += int(reach.any(2).sum())  # union over the query heads of a KV head
        under = (log_mass - ub).masked_fill(~candidate, float("-inf"))
        s["violations"] += int((under > TOL).sum())
        s["strict_violations"] += int((under > 0).sum())
        s["max_under"] = max(s["max_under"], float(under.max()))
        slack = (ub - log_mass)[candidate]
        s["mean_slack"][0] += float(slack.sum())
        s["mean_slack"][1] += int(slack.numel())
        if approx is None:
            continue
        approx = approx.masked_fill(~candidate, float("-inf"))
        d = stats["approx"].setdefault(label, {"abs_err": [0.0, 0], "best_rank": []})
        err = (approx - log_mass)[candidate]
        d["abs_err"][0] += float(err.abs().sum())
        d["abs_err"][1] += int(err.numel())
        has = best > float("-inf")
        at_best = approx.gather(-1, log_mass.masked_fill(~candidate, float("-inf")).argmax(-1, keepdim=True))
        rank = (approx > at_best).sum(-1)  # (B, H, G): the exact best unit's place in its head's approximate order
        d["best_rank"].extend(rank[has].tolist())
        for k in KS:
            kk = min(k, count)
            top = approx.topk(kk, dim=-1)
            chosen = torch.zeros_like(candidate).scatter_(-1, top.indices, top.values > float("-inf"))
            union = chosen.any(2, keepdim=True) & candidate.any(2, keepdim=True)  # scored exactly for every head
            scored = log_mass.masked_fill(~union, float("-inf")).amax(-1)
            gap = (scored - held_mass).flatten(1).amax(-1)
            fire = gap > margin
            t = stats["topk"].setdefault(f"{label}:{k}", {"missed": 0, "extra": 0, "exact_units": 0, "best_found": 0})
            t["missed"] += int((full_fire & ~fire).sum())
            at = stats["topk_missed_at"].setdefault(f"{label}:{k}", {})
            for m in MARGINS:
                at[str(m)] = at.get(str(m), 0) + int(((full_gap > m) & ~(gap > m)).sum())
            t["extra"] += int((fire & ~full_fire).sum())
            t["exact_units"] += int(union.sum())
            # query heads whose best exact unheld unit is in the scored union
            t["best_found"] += int(((scored >= best) & (best > float("-inf"))).sum())
            if bool((full_fire & ~fire).any()):
                stats["missed_gaps"].setdefault(f"{label}:{k}", []).append(float((full_gap - margin).max()))
            if CLOSED is not None and f"{label}:{k}" == ":".join(map(str, CLOSED)):
                closed_union = union
    if closed_union is not None:
        log_mass = log_mass.masked_fill(~held & ~closed_union, float("-inf"))
    return log_mass


rs.outlier_log_mass = capturing_mass
rs._without_opened_units = measuring_opened
from kvpolicy.cli import main  # noqa: E402

began = time.time()
try:
    main(sys.argv[1:])
except SystemExit as e:
    if e.code not in (None, 0):
        raise
stats["seconds"] = time.time() - began
stats["candidates_with_best"] = stats["pairs"]
stats["measured_query_rows"] = stats["rows"] * (stats["group"] or 0)
stats["closed"] = CLOSED
for d in stats["approx"].values():  # best_rank as a {rank: count} histogram (as the SmolLM2 raw files store it)
    hist = {}
    for x in d["best_rank"]:
        hist[str(x)] = hist.get(str(x), 0) + 1
    d["best_rank"] = hist
out = os.environ.get("KVPOLICY_LR33_OUT", "lowrank_stats.json")
with open(out, "w") as f:
    json.dump(stats, f)
print(f"wrote {out}: {stats['layer_steps']} layer steps, {stats['full_fires']} full fires, {stats['seconds']:.0f} s")
