"""Gemma 3 270M at 8K, budget 512, needle suite: this folder's seeds 2-3 (louiskv, clusterkv) beside the
existing seeds 0-1 cells, and the four seeds combined. Seeds 0-1 come from
  louiskv:   lowrank_session33/gate_cli/gemma3_8k_default_seed{0,1}.jsonl (session 33, int8 outlier keys; the
             latest default-trigger cells on these samples), with docs/eval/gemma3/session25_8k/results.jsonl
             (session 25, before int8 keys; the status table's 37.5 / 19.9%) shown as well
  clusterkv: docs/eval/gemma3/session25_8k/results.jsonl
Run from the repository root: python docs/eval/reuse/gemma3_8k_512_seeds23_session34/combine.py"""
import json

R = "docs/eval/"
HERE = R + "reuse/gemma3_8k_512_seeds23_session34/results.jsonl"
S25 = R + "gemma3/session25_8k/results.jsonl"
S33 = [R + f"reuse/lowrank_session33/gate_cli/gemma3_8k_default_seed{s}.jsonl" for s in (0, 1)]
TASKS = ["niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery"]


def load(paths, preset, seeds):
    out = {}
    for p in paths:
        for line in open(p, encoding="utf-8"):
            r = json.loads(line)
            if (r["preset"] == preset and r["length"] == 8192 and r["budget"] == 512 and r["task"] in TASKS
                    and r["seed"] in seeds and r.get("model") == "gemma3"):
                out[(r["task"], r["seed"])] = r
    return out


cols = {
    "louiskv s34 (seeds 2-3)": load([HERE], "louiskv", (2, 3)),
    "clusterkv s34 (seeds 2-3)": load([HERE], "clusterkv", (2, 3)),
    "louiskv s33 (seeds 0-1)": load(S33, "louiskv", (0, 1)),
    "louiskv s25 (seeds 0-1)": load([S25], "louiskv", (0, 1)),
    "clusterkv s25 (seeds 0-1)": load([S25], "clusterkv", (0, 1)),
}
louis = {**cols["louiskv s33 (seeds 0-1)"], **cols["louiskv s34 (seeds 2-3)"]}
cluster = {**cols["clusterkv s25 (seeds 0-1)"], **cols["clusterkv s34 (seeds 2-3)"]}

print("Per sample: score (louiskv's re-selecting share)")
print("| task | seed | louiskv | clusterkv | louiskv prediction | clusterkv prediction |")
print("|---|---:|---:|---:|---|---|")
for t in TASKS:
    for s in (0, 1, 2, 3):
        a, b = louis.get((t, s)), cluster.get((t, s))
        fa = "-" if a is None else f"{a['score']:.0f} ({100 * a['reselect_share']:.1f}%)"
        fb = "-" if b is None else f"{b['score']:.0f}"
        pa = "" if a is None else repr(a["prediction"][:40])
        pb = "" if b is None else repr(b["prediction"][:40])
        print(f"| {t.replace('niah_', '')} | {s} | {fa} | {fb} | `{pa}` | `{pb}` |")


def agg(name, rows):
    rows = list(rows.values())
    n = len(rows)
    if not n:
        return
    per = []
    for t in TASKS:
        v = [r["score"] for r in rows if r["task"] == t]
        per.append(f"{sum(v) / len(v):.1f}" if v else "-")
    share = [r["reselect_share"] for r in rows if r.get("reselect_share") is not None]
    print(f"| {name} | {sum(r['score'] for r in rows) / n:.1f} | "
          f"{100 * sum(share) / len(share):.1f}% | {100 * sum(r['recall'] for r in rows) / n:.1f}% | "
          + " | ".join(per) + f" | {n} |")


print()
print("| preset (cells) | needle score | re-selecting | recall | single | multikey | multivalue | multiquery | cells |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for name, rows in cols.items():
    agg(name, rows)
agg("louiskv seeds 0-3 (s33 + s34)", louis)
agg("clusterkv seeds 0-3 (s25 + s34)", cluster)
specs = {json.dumps(r["policy"], sort_keys=True) for r in louis.values()}
print(f"\nlouiskv policy specs across the 16 combined cells: {len(specs)} distinct")
