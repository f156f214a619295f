"""Each run's answer score, re-selecting share and recall (the eval's), the full trigger's (open loop) against the closed-loop
schemes': python scores.py RAW_FOLDER"""
import glob
import json
import os
import sys

folder = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(folder, "eval_*_results.jsonl"))):
    name = os.path.basename(path)[5:-len("_results.jsonl")]
    scheme = name.split("_closed_")[1].replace("-", ":") if "_closed_" in name else "full"
    for line in open(path):
        d = json.loads(line)
        rows.setdefault((d["task"], d["seed"]), {})[scheme] = (d["score"], d["reselect_share"], d["recall"])
schemes = sorted({s for v in rows.values() for s in v}, key=lambda s: (s != "full", s))
print("| task | seed | " + " | ".join(f"{s}: score, re-selecting, recall" for s in schemes) + " |")
print("|---|---:|" + "---:|" * len(schemes))
for (task, seed), v in sorted(rows.items()):
    print(f"| {task} | {seed} | " + " | ".join(f"{v[s][0]:.0f}, {v[s][1]:.1%}, {v[s][2]:.3f}" if s in v else "-" for s in schemes) + " |")
for s in schemes:
    cells = [v[s] for v in rows.values() if s in v and all(x in v for x in schemes)]
    if cells:
        print(f"\n{s}: mean score {sum(c[0] for c in cells) / len(cells):.1f} over {len(cells)} cells "
              f"(those every scheme ran), mean re-selecting {sum(c[1] for c in cells) / len(cells):.1%}, mean recall "
              f"{sum(c[2] for c in cells) / len(cells):.4f}", end="")
print()
