"""Per key block of session 81's traced (192, 128) backwards: mean query-block time, deterministic against default.
Run from the repo root: python3 docs/perf/2026-12-07_s81_device/call3_timelines/per_key_block.py SEQLEN causal|none"""
import json, gzip, statistics as st, math, sys
sys.path.insert(0,'.')
from fa4gen.emulate.tiling import m_block_range
D='docs/perf/2026-12-07_s81_device/call3_timelines/'
def load(name): return json.load(gzip.open(D+name+'.json.gz'))
def nq(n,S,causal):
    if not causal: return math.ceil(S/64)
    lo,hi=m_block_range(n,96,64,S,S,-1,-1,0,causal=True,local=False,chunked=False); return hi-lo
S=int(sys.argv[1]); mask=sys.argv[2]; causal = mask=='causal'
num_n=math.ceil(S/96); hb=(16384//S)*10
def grp(limit):
    g=1
    for k in range(1,5):
        sz=1<<k
        if limit>=sz and hb%sz==0: g=max(g,sz)
    return g
gdet=grp(min(max((50*1024*1024//1408)//S,1),16))
gdef=grp(max(186//num_n,1)) if causal else None
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
