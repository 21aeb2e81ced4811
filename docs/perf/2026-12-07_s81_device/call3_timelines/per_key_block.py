"""Per key block of session 81's traced (192, 128) backwards: mean query-block time, deterministic against default.
Run from the repo root: python3 docs/perf/2026-12-07_s81_device/call3_timelines/per_key_block.py SEQLEN causal|none"""
import json, gzip, statistics as st, math, sys
sys.path.insert(0,'.')
sys.path.insert(0,'docs/perf/2026-12-07_s82_device')
from grid_rows import pair_group, det_group, query_blocks as nq
D='docs/perf/2026-12-07_s81_device/call3_timelines/'
def load(name): return json.load(gzip.open(D+name+'.json.gz'))
S=int(sys.argv[1]); mask=sys.argv[2]; causal = mask=='causal'
num_n=math.ceil(S/96)
gdet=det_group(S)
gdef=pair_group(S,max(186//num_n,1)) if causal else None
res={}
for det,g,rev in (('_det',gdet,True),('',gdef,False)):
    r=load(f'timeline_d192x128_{mask}{det}'); c=r['cells'][str(S)]; rows=c['rows']; ghz=c['summary']['clock_ghz']
    t0=min(x[1] for x in rows)
    per={}
    for i,row in enumerate(rows):
        if g:
            y=(i//g)%num_n; n= num_n-1-y if rev else y
        else:
            n=i % num_n  # the default no-mask grid's order is not decoded here: its key blocks all do the same work
        per.setdefault(n,[]).append(((row[4]-row[3])/ghz/1e3, (row[1]-t0)/ghz/1e3))
    res[det]=per
print('g det',gdet,'g def',gdef)
print('n  nq  det_blk_us def_blk_us  det/blk def/blk  extra_us')
for n in range(num_n):
    q=nq(n,S,causal)
    if q==0: continue
    a=st.fmean(x[0] for x in res['_det'][n]); b=st.fmean(x[0] for x in res[''][n]) if n in res[''] else float('nan')
    if n%max(1,num_n//22)==0: print(f'{n:3d} {q:3d} {a:8.1f} {b:8.1f} {a/q:6.2f} {b/q:6.2f} {a-b:7.1f}')
