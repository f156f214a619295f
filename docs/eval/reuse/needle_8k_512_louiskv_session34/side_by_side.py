"""Per-sample side-by-side, SmolLM2 8K, budget 512, needle suite, seeds 0-3: louiskv as it is at
session 34 (this folder) against louiskv's session-21 cells (outlier_keys_session21/needle_8k_results.jsonl,
label out4-each-0.5, the same trigger spec), clusterkv (needle_8k_512_16samples) and quest / arkvale
(needle_8k_512_peers_session34). Adapted from needle_8k_512_peers_session34/side_by_side.py.
Run from the repository root:
python docs/eval/reuse/needle_8k_512_louiskv_session34/side_by_side.py"""
import json

R = "docs/eval/reuse/"
SOURCES = [  # (column, file, preset label in that file)
    ("louiskv s34", R + "needle_8k_512_louiskv_session34/results.jsonl", "louiskv"),
    ("louiskv s21", R + "outlier_keys_session21/needle_8k_results.jsonl", "out4-each-0.5"),
    ("clusterkv", R + "needle_8k_512_16samples/results.jsonl", "clusterkv"),
    ("quest", R + "needle_8k_512_peers_session34/results.jsonl", "quest"),
    ("arkvale", R + "needle_8k_512_peers_session34/results.jsonl", "arkvale"),
]
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]
SEEDS = [0, 1, 2, 3]

cells = {}
for col, path, label in SOURCES:
    for line in open(path, encoding="utf-8"):
        r = json.loads(line)
        if (r["preset"] == label and r["length"] == 8192 and r["budget"] == 512
                and r.get("model", "smollm2") == "smollm2" and r["task"] in TASKS and r["seed"] in SEEDS):
            cells[(col, r["task"], r["seed"])] = r  # the later line wins
cols = [c for c, _, _ in SOURCES]

print("Per sample: credited score (re-selecting share where the preset has one)")
print("| task | seed | " + " | ".join(cols) + " |")
print("|---|---:|" + "---:|" * len(cols))
for t in TASKS:
    for s in SEEDS:
        vals = []
        for c in cols:
            r = cells.get((c, t, s))
            if r is None:
                vals.append("-")
            elif c.startswith("louiskv"):
                vals.append(f"{r['score']:.0f} ({100 * r['reselect_share']:.1f}%)")
            else:
                vals.append(f"{r['score']:.0f}")
        print(f"| {t.replace('niah_', '')} | {s} | " + " | ".join(vals) + " |")

print()
print("| preset | needle score | re-selecting | recall | single | multikey | multivalue | multiquery | seeds 0-1 | cells |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for c in cols:
    rows = [r for k, r in cells.items() if k[0] == c]
    n = len(rows)
    if not n:
        print(f"| {c} | - | - | - | - | - | - | - | - | 0 |")
        continue
    per = []
    for t in TASKS:
        v = [r["score"] for r in rows if r["task"] == t]
        per.append(f"{sum(v) / len(v):.1f}" if v else "-")
    sub = [r["score"] for r in rows if r["seed"] in (0, 1)]
    share = 100 * sum(r["reselect_share"] for r in rows) / n
    recall = 100 * sum(r["recall"] for r in rows) / n
    print(f"| {c} | {sum(r['score'] for r in rows) / n:.1f} | {share:.1f}% | {recall:.1f}% | "
          + " | ".join(per) + f" | {sum(sub) / len(sub) if sub else float('nan'):.1f} | {n} |")

print("\nlouiskv session 34 against session 21, per sample (score, share, recall, prediction):")
changed = 0
for t in TASKS:
    for s in SEEDS:
        a, b = cells.get(("louiskv s34", t, s)), cells.get(("louiskv s21", t, s))
        if a is None or b is None:
            continue
        same = a["score"] == b["score"] and a["prediction"] == b["prediction"]
        changed += not same
        print(f"  {t:16s} seed {s}: s34 {a['score']:5.1f} {100 * a['reselect_share']:5.1f}% rec {100 * a['recall']:.2f}% {a['prediction']!r}"
              f" | s21 {b['score']:5.1f} {100 * b['reselect_share']:5.1f}% rec {100 * b['recall']:.2f}% {b['prediction']!r}"
              + ("" if same else "   <- changed"))
print(f"samples whose score or prediction changed: {changed}")
same_spec = all(cells[("louiskv s34", t, s)]["policy"] == cells[("louiskv s21", t, s)]["policy"]
                for t in TASKS for s in SEEDS
                if ("louiskv s34", t, s) in cells and ("louiskv s21", t, s) in cells)
print(f"recorded policy specs identical (s34 vs s21): {same_spec}")
