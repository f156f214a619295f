"""Mean top-1 agreement, KL and re-selection share per column of agreement.py's output, and the
tokens where the 3-iteration column and the default disagree (paired).

    python docs/eval/kmeans/summarise_agreement.py agreement.json
"""
import json
import sys

data = json.load(open(sys.argv[1], encoding="utf-8"))
columns = list(data["columns"])
samples = data["samples"]
print(f"{len(samples)} prompts x {data['steps'] - 1} tokens, {data['length']} tokens, budget {data['budget']}")
print("| column | top-1 agreement | KL | re-selecting |")
print("|---|---:|---:|---:|")
for c in columns:
    agree = [a for s in samples for a in s["columns"][c]["agree"]]
    kl = [k for s in samples for k in s["columns"][c]["kl"]]
    share = [s["columns"][c]["reselect_share"] or 0.0 for s in samples]
    print(f"| {c} | {100 * sum(agree) / len(agree):.1f}% | {sum(kl) / len(kl):.4f} | {100 * sum(share) / len(share):.1f}% |")
for base in ("louiskv", "clusterkv"):
    a = [x for s in samples for x in s["columns"][base]["agree"]]
    b = [x for s in samples for x in s["columns"][base + "-km3"]["agree"]]
    print(f"{base}: tokens only the default agrees on {sum(x > y for x, y in zip(a, b))}, "
          f"only km3 {sum(y > x for x, y in zip(a, b))}, of {len(a)}")
