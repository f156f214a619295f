"""How much of the unit table a bound could let the score-gap trigger skip, over one eval run (CPU, reference
kernels): wraps ``reference_step``'s outlier trigger and, at each (layer, step), bounds every block of ``S``
units' estimated log mass by a key box (each dimension's max and min over the block's vectors: outlier keys,
rest means, decode means; plus the log of its largest unit's size), then counts the (query head, block)
pairs whose bound reaches the firing threshold (the held units' log mass plus the layer's margin): those a
trigger that reads boxes first would still have to score. A bound below a unit that exceeds the threshold
would be a bug: counted as ``violations``.

    python docs/eval/reuse/bounds_session31/measure_bounds.py eval --device cpu --model smollm2 ...
"""
import sys

import torch

import kvpolicy.kernels.reference_step as rs

SIZES = (1, 4, 16, 64)
seen = {}
stats = {s: [0, 0, 0] for s in SIZES}  # pairs with a candidate, pairs whose bound reaches the threshold, violations
rows = [0, 0]  # (query head, layer, step) rows, rows where no block reaches the threshold
orig_mass, orig_opened = rs.outlier_log_mass, rs._without_opened_units


def capturing_mass(outliers, units, query, scale, each):
    seen.update(outliers=outliers, units=units, query=query, scale=scale, each=each)
    return orig_mass(outliers, units, query, scale, each)


def unit_boxes(outliers, units):
    """``(B, H, U, D)`` max and min over each unit's vectors, as ``outlier_log_mass`` scores them."""
    mean = units.key_mean.float()
    high, low = mean.clone(), mean.clone()
    prompt = outliers.rest_count.shape[-1]
    if prompt:
        keys = outliers.keys.float() * outliers.key_scale[..., None, None]
        valid = outliers.valid[..., None]
        rest = outliers.rest_mean.float() * outliers.rest_scale[..., None]
        has_rest = (outliers.rest_count > 0)[..., None]
        inf = float("inf")
        high[:, :, :prompt] = torch.maximum(keys.masked_fill(~valid, -inf).amax(3), rest.masked_fill(~has_rest, -inf))
        low[:, :, :prompt] = torch.minimum(keys.masked_fill(~valid, inf).amin(3), rest.masked_fill(~has_rest, inf))
    return high, low


def measuring_opened(trigger, state, log_mass, held):
    log_mass = orig_opened(trigger, state, log_mass, held)
    units, query, scale = seen["units"], seen["query"], seen["scale"]
    batch, heads, per_head, count = log_mass.shape
    group = query.float().view(batch, heads, -1, query.shape[-1])
    if not seen["each"]:
        group = group.mean(2, keepdim=True)
    finite = log_mass > float("-inf")
    held_mass = torch.logsumexp(log_mass.masked_fill(~held | ~finite, float("-inf")), -1)
    threshold = held_mass + trigger.margin_of(state.layer.layer_idx)  # (B, H, G)
    candidate = finite & ~held  # (B, H, G, U)
    high, low = unit_boxes(seen["outliers"], units)
    log_size = torch.log(units.size.clamp(min=1).float())
    fires = candidate & (log_mass > threshold[..., None])
    for size in SIZES:
        pad = (-count) % size
        blocks = (count + pad) // size

        def blocked(t, fill):
            return torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad), value=fill)

        bh = blocked(high, -1e30).view(batch, heads, blocks, size, -1).amax(3)
        bl = blocked(low, 1e30).view(batch, heads, blocks, size, -1).amin(3)
        bs = blocked(log_size, 0.0).view(batch, heads, blocks, size).amax(3)
        q = group[:, :, :, None, :]  # (B, H, G, 1, D)
        bound = torch.maximum(q * bh[:, :, None], q * bl[:, :, None]).sum(-1) * scale + bs[:, :, None]
        cand = torch.nn.functional.pad(candidate, (0, pad)).view(batch, heads, per_head, blocks, size).any(-1)
        fire = torch.nn.functional.pad(fires, (0, pad)).view(batch, heads, per_head, blocks, size).any(-1)
        reach = cand & (bound >= threshold[..., None])
        stats[size][0] += int(cand.sum())
        stats[size][1] += int(reach.sum())
        stats[size][2] += int((fire & ~reach).sum())
        if size == 16:
            rows[0] += reach.shape[0] * reach.shape[1] * reach.shape[2]
            rows[1] += int((~reach.any(-1)).sum())
    return log_mass


rs.outlier_log_mass = capturing_mass
rs._without_opened_units = measuring_opened
from kvpolicy.cli import main  # noqa: E402

try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("block size | (query head, block) pairs with a candidate | whose box bound reaches the threshold | share | "
      "violations")
for size, (cand, reach, bad) in stats.items():
    print(f"{size:10d} | {cand:12d} | {reach:12d} | {reach / max(cand, 1):.4f} | {bad}")
print(f"rows (query head, layer, step) where no 16-unit block reaches the threshold: {rows[1]} of {rows[0]} = "
      f"{rows[1] / max(rows[0], 1):.4f}")
