"""The share of (layer, step) pairs where score_gap's challengers option measured the whole table
(the schedule's step or a stale challenger list), over one eval run: wraps reference_step._challenged."""
import sys
import torch
import kvpolicy.kernels.reference_step as rs

orig = rs._challenged
counts = [0, 0]


def counting(trigger, state, unheld):
    ids = state.challengers
    schedule = (state.steps + state.layer.layer_idx) % trigger.every == 0
    if ids is None or ids.shape[:-1] != unheld.shape[:-1]:
        stale = torch.ones_like(schedule)
    else:
        listed = ids >= 0
        alive = unheld.gather(-1, ids.clamp(min=0)) > float("-inf")
        stale = (listed & ~alive).flatten(1).any(-1) | ~listed.flatten(1).any(-1)
    measured = schedule | stale
    counts[0] += int(measured.sum())
    counts[1] += measured.numel()
    return orig(trigger, state, unheld)


rs._challenged = counting
from kvpolicy.cli import main  # noqa: E402

try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(f"whole-table share: {counts[0]} of {counts[1]} = {counts[0] / max(counts[1], 1):.3f}")
