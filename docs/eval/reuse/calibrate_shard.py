"""A calibration shard of score_gap with options the CLI does not expose (`kvpolicy calibrate`'s
measurement, written as `--shard-out` writes it; choose with `kvpolicy calibrate --merge SHARD`).

    OMP_NUM_THREADS=1 python docs/eval/reuse/calibrate_shard.py OUT.json '{"measure": "mass", "leaving": "ignored"}' -1,-2,-2.5,-3,-4 [FIRST LAST]

Samples FIRST..LAST-1 (default 0..7), each 2,048 tokens, 16 teacher-forced steps, budget 512.
"""
import dataclasses
import json
import sys

from kvpolicy.eval.calibrate import measure_taus
from kvpolicy.models import load_model

out, options, margins = sys.argv[1], json.loads(sys.argv[2]), [float(m) for m in sys.argv[3].split(",")]
first, last = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (0, 8)
model, tok = load_model("smollm2")
measured = measure_taus(model, tok, taus=margins, sample_ids=range(first, last), length=2048, steps=16, budget=512,
                        trigger="score_gap", options=options,
                        progress=lambda done, total: print(f"{done}/{total}", flush=True))
with open(out, "w", encoding="utf-8") as f:
    json.dump(dataclasses.asdict(measured), f, indent=1)
