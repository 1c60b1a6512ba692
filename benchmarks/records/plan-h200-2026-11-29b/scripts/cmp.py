import json,sys,collections
d=collections.defaultdict(list)
for f,tree in ((sys.argv[1],'base'),(sys.argv[2],'new')):
    for l in open(f):
        r=json.loads(l); d[(r['workload'],r['candidate'],r['rate_per_gpu'],tree)].append((r['seed'],r['attainment']*100, r['cut']))
keys=sorted({k[:3] for k in d})
for k in keys:
    b=sorted(d[k+('base',)]); n=sorted(d[k+('new',)])
    fb=' '.join('%5.1f%s'%(a,'*' if c else ' ') for _,a,c in b); fn=' '.join('%5.1f%s'%(a,'*' if c else ' ') for _,a,c in n)
    hb=sum(a>=90 for _,a,_ in b); hn=sum(a>=90 for _,a,_ in n)
    print('%-14s %-15s %6s | base %s (%d hold) | new %s (%d hold)'%(k[0],k[1],k[2],fb,hb,fn,hn))
