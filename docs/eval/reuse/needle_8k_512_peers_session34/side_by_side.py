"""Per-sample side-by-side of quest, arkvale (this folder), clusterkv (needle_8k_512_16samples)
and louiskv's outlier default (outlier_keys_session21/needle_8k_results.jsonl, out4-each-0.5),
SmolLM2 8K, budget 512, needle suite, seeds 0-3. Run from the repository root:
python docs/eval/reuse/needle_8k_512_peers_session34/side_by_side.py"""
import json
from collections import defaultdict

R = "docs/eval/reuse/"
SOURCES = [  # (column, file, preset label in that file)
    ("quest", R + "needle_8k_512_peers_session34/results.jsonl", "quest"),
    ("arkvale", R + "needle_8k_512_peers_session34/results.jsonl", "arkvale"),
    ("clusterkv", R + "needle_8k_512_16samples/results.jsonl", "clusterkv"),
    ("louiskv (out4-each-0.5)", R + "outlier_keys_session21/needle_8k_results.jsonl", "out4-each-0.5"),
]
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]
SEEDS = [0, 1, 2, 3]

cells = {}
for col, path, label in SOURCES:
    for line in open(path, encoding="utf-8"):
        r = json.loads(line)
        if r["preset"] == label and r["length"] == 8192 and r["budget"] == 512:
            cells[(col, r["task"], r["seed"])] = r  # the later line wins
cols = [c for c, _, _ in SOURCES]

print("| task | seed | " + " | ".join(cols) + " |")
print("|---|---:|" + "---:|" * len(cols))
for t in TASKS:
    for s in SEEDS:
        vals = []
        for c in cols:
            r = cells.get((c, t, s))
            vals.append("-" if r is None else f"{r['score']:.0f}")
        print(f"| {t.replace('niah_', '')} | {s} | " + " | ".join(vals) + " |")

print()
print("| preset | needle score | re-selecting | recall | single | multikey | multivalue | multiquery | seeds 0-1 | cells |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in cols:
    rows = [r for k, r in cells.items() if k[0] == c]
    n = len(rows)
    per = []
    for t in TASKS:
        v = [r["score"] for r in rows if r["task"] == t]
        per.append(f"{sum(v) / len(v):.1f}" if v else "-")
    sub = [r["score"] for r in rows if r["seed"] in (0, 1)]
    share = 100 * sum(r["reselect_share"] for r in rows) / n
    recall = 100 * sum(r["recall"] for r in rows) / n
    print(f"| {c} | {sum(r['score'] for r in rows) / n:.1f} | {share:.1f}% | {recall:.1f}% | "
          + " | ".join(per) + f" | {sum(sub) / len(sub):.1f} | {n} |")

print("\npredictions:")
for t in TASKS:
    for s in SEEDS:
        print(f"{t} seed {s}:")
        for c in cols:
            r = cells.get((c, t, s))
            if r is not None:
                print(f"  {c:24s} {r['score']:5.1f}  {r['prediction']!r}")

# the GPU grid's quest and arkvale cells (docs/eval/results.jsonl, seeds 0-1), beside this run's CPU cells
print("\nseeds 0-1, this CPU run against the GPU grid (docs/eval/results.jsonl):")
gpu = {}
for line in open("docs/eval/results.jsonl", encoding="utf-8"):
    r = json.loads(line)
    if (r["preset"] in ("quest", "arkvale") and r["length"] == 8192 and r["budget"] == 512
            and r.get("model", "smollm2") == "smollm2" and r["task"] in TASKS):
        gpu[(r["preset"], r["task"], r["seed"])] = r
print("| task | seed | quest CPU | quest GPU | arkvale CPU | arkvale GPU |")
print("|---|---:|---:|---:|---:|---:|")
tot = defaultdict(list)
for t in TASKS:
    for s in (0, 1):
        vals = []
        for p in ("quest", "arkvale"):
            for name, src in (("CPU", cells.get((p, t, s))), ("GPU", gpu.get((p, t, s)))):
                vals.append("-" if src is None else f"{src['score']:.0f}")
                if src is not None:
                    tot[(p, name)].append(src["score"])
        print(f"| {t.replace('niah_', '')} | {s} | " + " | ".join(vals) + " |")
print("| mean | | " + " | ".join(
    f"{sum(tot[(p, n)]) / len(tot[(p, n)]):.1f} ({len(tot[(p, n)])})" if tot[(p, n)] else "-"
    for p in ("quest", "arkvale") for n in ("CPU", "GPU")) + " |")
