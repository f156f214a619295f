import json, collections
rows = [json.loads(l) for l in open('docs/eval/reuse/needle_4k_512_results.jsonl')]
latest = {}
for r in rows:
    latest[(r['task'], r['seed'], r['preset'])] = r
by = collections.defaultdict(list)
for (task, seed, preset), r in latest.items():
    by[preset].append(r)
tasks = ['niah_single', 'niah_multikey', 'niah_multivalue', 'niah_multiquery']
print('| preset | needle score | re-selecting | single | multikey | multivalue | multiquery | cells |')
for p, rs in sorted(by.items(), key=lambda kv: -(sum(r['reselect_share'] or 1 for r in kv[1]) / len(kv[1]))):
    score = sum(r['score'] for r in rs) / len(rs)
    sh = [r['reselect_share'] for r in rs if r['reselect_share'] is not None]
    share = f"{100*sum(sh)/len(sh):.1f}%" if sh else '-'
    per = [sum(r['score'] for r in rs if r['task'] == t) / max(1, sum(1 for r in rs if r['task'] == t)) for t in tasks]
    print(f"| {p} | {score:.1f} | {share} | " + " | ".join(f"{x:.1f}" for x in per) + f" | {len(rs)} |")
