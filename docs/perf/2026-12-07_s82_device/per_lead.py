"""Per-block time of session 82's traced (192, 128) deterministic backwards against how much earlier the next key block's
CTA (same batch / head; the one whose turn this CTA waits for) started its blocks. Run from the repo root:
python3 docs/perf/2026-12-07_s82_device/per_lead.py ref|p1|p2 SEQLEN [causal|none]"""
import json,gzip,math,sys,statistics as st
sys.path.insert(0,'.')
sys.path.insert(0,'docs/perf/2026-12-07_s82_device')
from grid_rows import det_group, query_blocks
S=int(sys.argv[2]); tree=sys.argv[1]; mask=sys.argv[3] if len(sys.argv)>3 else 'causal'
causal=mask=='causal'
r=json.load(gzip.open(f'docs/perf/2026-12-07_s82_device/tl_{tree}/timeline_d192x128_{mask}_det.json.gz'))
c=r['cells'][str(S)]; rows=c['rows']; ghz=c['summary']['clock_ghz']
num_n=math.ceil(S/96)
g=det_group(S)
def nq(n): return query_blocks(n,S,causal)
cta={}
for i,row in enumerate(rows):
    y=(i//g)%num_n; n=num_n-1-y; p=(i%g)+g*(i//(g*num_n))
    cta[(p,n)]=row
t0=min(x[1] for x in rows)
us=lambda a:a/ghz/1e3
# per block time vs lead of CTA n+1 (its blocks-start earlier by lead)
buckets={}
for (p,n),row in cta.items():
    q=nq(n)
    if q==0: continue
    pb=us(row[4]-row[3])/q
    if (p,n+1) in cta:
        lead=us(row[3]-cta[(p,n+1)][3])  # how much later this CTA started its blocks than n+1
        b=min(int(lead//20),10) if lead>=0 else -1
        buckets.setdefault(b,[]).append(pb)
print(tree,S,mask,'g',g,'per-block us by (start of n) - (start of n+1) in 20us buckets')
for b in sorted(buckets): print(f'{b*20:5d}+ {len(buckets[b]):5d} {st.fmean(buckets[b]):.2f}')
byn={}
for (p,n),row in cta.items():
    q=nq(n)
    if q: byn.setdefault(n,[]).append(us(row[4]-row[3])/q)
print('by n:',' '.join(f'{n}:{st.fmean(v):.2f}' for n,v in sorted(byn.items())))
