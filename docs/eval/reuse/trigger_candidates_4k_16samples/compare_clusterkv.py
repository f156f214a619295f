"""Each 16-sample column against every-step clusterkv: score, share, samples whose credited score differs, values lost and
gained. python docs/eval/reuse/trigger_candidates_4k_16samples/compare_clusterkv.py docs/eval/reuse/needle_4k_512_16samples/results.jsonl RESULTS.jsonl"""
import json, sys
from collections import defaultdict
cells = {}
for path in sys.argv[1:]:
    for line in open(path):
        r = json.loads(line)
        cells[(r["preset"], r["task"], r["seed"])] = r
cols = list(dict.fromkeys(k[0] for k in cells))
samples = sorted({k[1:] for k in cells})
print("| column | score | re-selecting | samples differing from clusterkv (down / up) | values lost / gained |")
for c in cols:
    rows = [cells[(c, *s)] for s in samples if (c, *s) in cells]
    if len(rows) < 16: continue
    down = up = lost = gained = 0
    for s in samples:
        a, b = cells[("clusterkv", *s)]["score"], cells[(c, *s)]["score"]
        n = 4 if "multiquery" in s[0] or "multivalue" in s[0] else 1
        if b < a: down += 1; lost += round((a - b) / 100 * n)
        if b > a: up += 1; gained += round((b - a) / 100 * n)
    sc = sum(r["score"] for r in rows) / 16; sh = 100 * sum(r["reselect_share"] for r in rows) / 16
    print(f"| {c} | {sc:.1f} | {sh:.1f}% | {down + up} ({down} / {up}) | {lost} / {gained} |")
