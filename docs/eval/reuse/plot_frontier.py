"""Needle score against re-selection share, one line per trigger design (EVAL.md's frontier plot).

    python docs/eval/reuse/plot_frontier.py RESULTS.jsonl OUT.png [LENGTH] [TITLE]

TITLE: the plot's title (default: SmolLM2's CPU cells). Every-step references found in RESULTS
(clusterkv, quest, arkvale, oracle, pariskv, pariskv-head_max, full) are drawn as markers.
"""
import collections
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

path, out = sys.argv[1], sys.argv[2]
length = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
title = sys.argv[4] if len(sys.argv) > 4 else f"SmolLM2-135M, {length // 1024}K needles, budget 512 (CPU)"
latest = {}
for line in open(path):
    if line.strip():
        r = json.loads(line)
        if r["length"] == length:
            latest[(r["task"], r["seed"], r["preset"], r["budget"])] = r
by = collections.defaultdict(list)
for (_, _, preset, budget), r in latest.items():
    by[preset].append(r)


def point(rows):
    shares = [r["reselect_share"] for r in rows if r["reselect_share"] is not None]
    return (100 * sum(shares) / len(shares) if shares else None), sum(r["score"] for r in rows) / len(rows)


families = {
    "score_gap, mass, anchor fill (before)": lambda p: p.startswith("mass-"),
    "score_gap, mass, held list": lambda p: p.startswith("held-"),
    "score_gap, mass, held list, leaving ignored": lambda p: p.startswith("ign-") and not p.endswith("-f1"),
    "the same, follow 1": lambda p: p.startswith("ign-") and p.endswith("-f1"),
    "the same, admit=\"evict\"": lambda p: p.startswith("evict-"),
    "score_gap, weakest": lambda p: p.startswith("gap-"),
    "query_cosine (LouisKV's)": lambda p: p.startswith("louis-") or p == "louiskv-paper",
    "interval(n)": lambda p: p.startswith("interval-"),
}
fig, ax = plt.subplots(figsize=(7, 4.5))
for label, member in families.items():
    pts = sorted(point(rows) + (p,) for p, rows in by.items() if member(p))
    if pts:
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], marker="o", label=label)
        for x, y, p in pts:
            ax.annotate(p.split("-", 1)[1], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
for name, style in (("clusterkv", "s"), ("quest", "^"), ("arkvale", "v"), ("oracle", "D"), ("pariskv", "x"),
                    ("pariskv-head_max", "P"), ("full", "*")):
    if name in by:
        x, y = point(by[name])
        ax.scatter([100 if x is None else x], [y], marker=style, s=80, label=f"{name} (every step)" if x else name,
                   zorder=3)
ax.axvline(25, color="grey", ls=":", lw=1)
ax.set_xlabel("re-selecting (% of (layer, step) pairs)")
ax.set_ylabel("needle score (4 tasks x 2 seeds)")
ax.set_title(title)
ax.legend(fontsize=8, loc="lower right")
fig.tight_layout()
fig.savefig(out, dpi=120)
print("wrote", out)
