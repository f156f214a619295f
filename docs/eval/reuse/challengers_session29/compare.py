"""Per-sample needle scores of the challengers columns beside the shipped default's (session 25) and every=2's (session 26)."""
import json, sys
base = "docs/eval/reuse/"  # run from the repository root
cols = {"default": base + "int8_keys_session25/smollm2_4k_seeds6-9_int8_shipped_results.jsonl",
        "every2": base + "every_session26/smollm2_4k_seeds6-9_every2_results.jsonl",
        "every3": base + "every_session26/smollm2_4k_seeds6-9_every3_results.jsonl"}
for name in sys.argv[1:]:
    cols[name] = base + f"challengers_session29/smollm2_4k_seeds6-9_{name}_results.jsonl"
rows = {}
for name, path in cols.items():
    for line in open(path):
        r = json.loads(line)
        rows.setdefault((r["task"], r["seed"]), {})[name] = (r["score"], r["reselect_share"])
print("| cell | " + " | ".join(cols) + " |")
print("|---|" + "---:|" * len(cols))
for key in sorted(rows):
    vals = rows[key]
    scores = [vals.get(c, (None, None))[0] for c in cols]
    if len(set(scores)) > 1:
        print(f"| {key[0]} {key[1]} | " + " | ".join(f"{s:.0f}" if s is not None else "-" for s in scores) + " |")
for c in cols:
    got = [v[c] for v in rows.values() if c in v]
    print(c, "mean score %.1f, re-selecting %.1f%%, cells %d" % (sum(s for s, _ in got) / len(got), 100 * sum(r for _, r in got) / len(got), len(got)))
