"""Needle score, re-selection share and miss fraction (after each layer's first selection; cells that
recorded it) per column of a results.jsonl (the frontier tables of EVAL.md).

    python docs/eval/reuse/frontier.py RESULTS.jsonl [LENGTH]
"""
import collections
import json
import sys

path = sys.argv[1]
length = int(sys.argv[2]) if len(sys.argv) > 2 else None
latest = {}
for line in open(path):
    if not line.strip():
        continue
    r = json.loads(line)
    if length is not None and r['length'] != length:
        continue
    latest[(r['task'], r['length'], r['seed'], r['preset'], r['budget'])] = r
by = collections.defaultdict(list)
for (task, length_, seed, preset, budget), r in latest.items():
    by[(preset, budget)].append(r)
tasks = ['niah_single', 'niah_multikey', 'niah_multivalue', 'niah_multiquery']
print('| column | budget | needle score | re-selecting | miss (warm) | single | multikey | multivalue | multiquery | cells |')
print('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
for (p, budget), rs in sorted(by.items(), key=lambda kv: (-(sum(r['reselect_share'] or 1 for r in kv[1]) / len(kv[1])), kv[0][0])):
    score = sum(r['score'] for r in rs) / len(rs)
    sh = [r['reselect_share'] for r in rs if r['reselect_share'] is not None]
    share = f"{100 * sum(sh) / len(sh):.1f}%" if sh else '-'
    mf = [r['miss_fraction_warm'] for r in rs if r.get('miss_fraction_warm') is not None]
    miss = f"{100 * sum(mf) / len(mf):.1f}% ({len(mf)})" if mf else '-'
    per = [sum(r['score'] for r in rs if r['task'] == t) / max(1, sum(1 for r in rs if r['task'] == t)) for t in tasks]
    print(f"| {p} | {budget or 'all'} | {score:.1f} | {share} | {miss} | " + " | ".join(f"{x:.1f}" for x in per) + f" | {len(rs)} |")
