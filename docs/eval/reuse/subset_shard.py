"""A calibration shard cut to some of its settings (so it merges with a shard that swept only those).

    python docs/eval/reuse/subset_shard.py IN.json OUT.json -2.5,-3
"""
import json
import sys

src, out, keep = sys.argv[1], sys.argv[2], sorted(float(m) for m in sys.argv[3].split(","))
shard = json.load(open(src, encoding="utf-8"))
missing = [m for m in keep if m not in shard["taus"]]
if missing:
    sys.exit(f"{src} did not measure {missing}")
shard["taus"] = keep
for name in ("reselect_share", "top1_agreement", "kl_mean"):
    shard[name] = {str(m): shard[name][str(m)] for m in keep}
json.dump(shard, open(out, "w", encoding="utf-8"))
