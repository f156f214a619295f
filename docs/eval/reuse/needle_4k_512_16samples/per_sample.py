"""Per-sample scores and predictions of every column, and each column's needle score and
re-selection share over all seeds and over a subset of seeds:
python docs/eval/reuse/needle_4k_512_16samples/per_sample.py RESULTS.jsonl [SUBSET_SEEDS, default 0,1]"""

import json
import sys
from collections import defaultdict

path = sys.argv[1]
subset = {int(s) for s in (sys.argv[2] if len(sys.argv) > 2 else "0,1").split(",")}
cells = {}
for line in open(path, encoding="utf-8"):
    row = json.loads(line)
    cells[(row["preset"], row["task"], row["length"], row["budget"], row["seed"])] = row  # the later line wins
cols = list(dict.fromkeys(k[0] for k in cells))
samples = sorted({k[1:] for k in cells})

print("| task | length | seed | " + " | ".join(cols) + " |")
print("|---|---:|---:|" + "---:|" * len(cols))
for s in samples:
    vals = []
    for c in cols:
        r = cells.get((c, *s))
        vals.append("-" if r is None else f"{r['score']:.0f} ({100 * r['reselect_share']:.0f}%)")
    print(f"| {s[0]} | {s[1]} | {s[3]} | " + " | ".join(vals) + " |")

print()
for name, seeds in (("all seeds", None), (f"seeds {sorted(subset)}", subset)):
    print(f"{name}:")
    for c in cols:
        rows = [r for k, r in cells.items() if k[0] == c and (seeds is None or k[4] in seeds)]
        if not rows:
            continue
        n = len(rows)
        by_task = defaultdict(list)
        for r in rows:
            by_task[r["task"]].append(r["score"])
        tasks = ", ".join(f"{t.replace('niah_', '')} {sum(v) / len(v):.1f}" for t, v in by_task.items())
        print(f"  {c:12s} n={n:2d} score {sum(r['score'] for r in rows) / n:5.1f}  "
              f"re-selecting {100 * sum(r['reselect_share'] for r in rows) / n:5.1f}%  "
              f"recall {100 * sum(r['recall'] for r in rows) / n:5.1f}%  {tasks}")

print("\npredictions:")
for s in samples:
    print(f"{s[0]} {s[1]} seed {s[3]}:")
    for c in cols:
        r = cells.get((c, *s))
        if r is not None:
            print(f"  {c:12s} {r['score']:5.1f}  {r['prediction']!r}")
