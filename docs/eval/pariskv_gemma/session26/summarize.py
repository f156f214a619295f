"""Scores per preset over the cells of one or more results.jsonl files."""
import json, sys, collections
rows = [json.loads(l) for f in sys.argv[1:] for l in open(f)]
by = collections.defaultdict(dict)
for r in rows:
    by[r["preset"]][(r["task"], r["length"], r["seed"])] = r
cells = sorted({k for d in by.values() for k in d})
print("preset".ljust(14), " ".join(f"{t.replace('niah_', '')[:6]}{s}@{l // 1024}K" for t, l, s in cells), "| mean recall")
for p, d in by.items():
    sc = [d[c]["score"] if c in d else float("nan") for c in cells]
    rec = [d[c]["recall"] for c in cells if c in d]
    print(p.ljust(14), " ".join(f"{x:9.0f}" for x in sc), f"| {sum(x for x in sc if x == x) / len(sc):5.1f} {100 * sum(rec) / len(rec):5.1f}%")
