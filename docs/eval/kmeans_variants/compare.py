"""Score, re-selection share and recall per column, and the samples whose answers differ from the
default column's: python docs/eval/kmeans_variants/compare.py RESULTS.jsonl [DEFAULT_LABEL]

Two readings of "differ": the prediction text differs (anywhere, the continuation after the answer
included), and the credited answers differ (which of the sample's expected strings the scorer
found in it; the samples are rebuilt with the embedded SmolLM2 tokenizer)."""

import json
import sys
from collections import defaultdict

path = sys.argv[1]
default = sys.argv[2] if len(sys.argv) > 2 else "louiskv"
cells = {}
for line in open(path, encoding="utf-8"):
    row = json.loads(line)
    cells[(row["preset"], row["task"], row["length"], row["budget"], row["seed"])] = row  # the later line wins
cols = defaultdict(dict)
for (preset, *sample), row in cells.items():
    cols[preset][tuple(sample)] = row
base = cols[default]

from kvpolicy.eval.tasks import make_sample  # noqa: E402
from kvpolicy.models import load_model  # noqa: E402

_, tokenizer = load_model("smollm2")
expected = {}
for (task, length, budget, seed) in base:
    expected[(task, length, budget, seed)] = make_sample(task, tokenizer, length, seed).answers


def credited(sample, row):
    return sorted(a for a in expected[sample] if a.lower() in row["prediction"].lower())


print(f"{'column':24s} {'n':>3s} {'score':>6s} {'reselect':>8s} {'recall':>7s} {'by task':s}")
for name, col in cols.items():
    rows = list(col.values())
    n = len(rows)
    score = sum(r["score"] for r in rows) / n
    share = sum(r["reselect_share"] for r in rows) / n
    recall = sum(r["recall"] for r in rows) / n
    tasks = defaultdict(list)
    for (task, *_), r in col.items():
        tasks[task].append(r["score"])
    by_task = ", ".join(f"{t.replace('niah_', '')} {sum(v) / len(v):.1f}" for t, v in tasks.items())
    print(f"{name:24s} {n:3d} {score:6.1f} {100 * share:7.1f}% {100 * recall:6.1f}%  {by_task}")
for name, col in cols.items():
    if name == default:
        continue
    common = [s for s in col if s in base]
    differ = [s for s in common if col[s]["prediction"] != base[s]["prediction"]]
    credit = [s for s in common if credited(s, col[s]) != credited(s, base[s])]
    print(f"\n{name} against {default}: {len(common)} samples in common; prediction text differs in "
          f"{len(differ)}, credited answers differ in {len(credit)}")
    for s in differ:
        mark = "CREDIT DIFFERS" if s in credit else "same credit"
        print(f"  {s[0]} {s[1]} budget {s[2]} seed {s[3]}: score {base[s]['score']:.0f} -> {col[s]['score']:.0f} "
              f"({mark}: {credited(s, base[s])} -> {credited(s, col[s])}; expected {list(expected[s])})")
        print(f"    {default}: {base[s]['prediction']!r}")
        print(f"    {name}: {col[s]['prediction']!r}")
