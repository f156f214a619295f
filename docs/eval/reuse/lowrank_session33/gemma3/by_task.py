"""Missed fires by task (open loop, preset margin): python by_task.py RAW_DIR KEY ..."""
import glob
import json
import os
import sys

folder, keys = sys.argv[1], sys.argv[2:]
rows = {}
for p in sorted(glob.glob(os.path.join(folder, "niah_*_seed*.json"))):
    if "_closed_" in p:
        continue
    task = os.path.basename(p).rsplit("_seed", 1)[0]
    d = json.load(open(p))
    r = rows.setdefault(task, {"steps": 0, "fires": 0, **{k: 0 for k in keys}})
    r["steps"] += d["layer_steps"] - d["no_selection_steps"]
    r["fires"] += d["full_fires"]
    for k in keys:
        r[k] += d["topk"][k]["missed"]
print("| task | measured (layer, step) | full fires | " + " | ".join(keys) + " |")
print("|---|---:|---:|" + "---:|" * len(keys))
for task, r in rows.items():
    print(f"| {task} | {r['steps']:,} | {r['fires']} | " + " | ".join(str(r[k]) for k in keys) + " |")
