# The eval cells in DIR (subfolders s4k_*, s8k_*) against the louiskv preset's fixed_query cells of sessions 34-35,
# answer by answer. Run from the repository root: python3 docs/eval/reuse/margin_session37/compare.py DIR
import json, sys, os, statistics as st
def load(p, preset=None):
    d={}
    for l in open(p):
        r=json.loads(l)
        if preset and r['preset']!=preset: continue
        d[(r['task'],r['seed'])]=(r['score'],r['prediction'].strip()[:30],round(r['reselect_share'],3))
    return d
W='docs/eval/reuse/'
a={}
a.update(load(W+'fixed_query_session35/fixed4k/results.jsonl'))
a.update(load(W+'fixed_query_session34/results.jsonl','fixed'))
for s in ('s01','s23'):
    p=W+'fixed_query_session35/smollm2_8k/'+s+'/results.jsonl'
    if os.path.exists(p):
        for k,v in load(p).items(): a[('8k',)+k]=v
base=sys.argv[1]
for L in ('4k','8k'):
    b={}
    for sub in os.listdir(base):
        p=os.path.join(base,sub,'results.jsonl')
        if sub.startswith('s'+L) and os.path.exists(p):
            for k,v in load(p).items(): b[k if L=='4k' else ('8k',)+k]=v
    if not b: continue
    same=sum(a[k][1]==b[k][1] for k in b)
    for k in sorted(b):
        if a[k][1]!=b[k][1]: print(' ', k, a[k], b[k])
    print(L, len(b), 'same answers', same, 'score %.1f vs %.1f' % (st.mean(v[0] for v in b.values()), st.mean(a[k][0] for k in b)),
          'share %.1f%% vs %.1f%%' % (100*st.mean(v[2] for v in b.values()), 100*st.mean(a[k][2] for k in b)))
