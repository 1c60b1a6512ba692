import json,sys,collections,statistics as st
rs=[json.loads(l) for l in open(sys.argv[1])]
ttft=float(sys.argv[2]) if len(sys.argv)>2 else 1559.32; tpot=float(sys.argv[3]) if len(sys.argv)>3 else 14.0574
dec={r['request']:r for r in rs if r['kind']=='decision'}
tp={r['request']:r for r in rs if r['kind']=='tpot'}
by=collections.defaultdict(list)
for k,d in dec.items(): by[d['path']].append(k)
print({p:len(v) for p,v in by.items()})
for p,ks in by.items():
    t=[tp[k] for k in ks if k in tp]
    miss=[x for x in t if x['tpot_ms']>tpot]
    print(p,'tpot misses',len(miss),'of',len(t),'pred p50 %.1f had p50 %.1f'%(st.median([x['predicted_tpot_ms'] for x in t]),st.median([x['tpot_ms'] for x in t])) if t else '')
    if miss: print('   misses pred/had', [(round(x['predicted_tpot_ms'],1),round(x['tpot_ms'],1),x['num_output']) for x in miss][:12])
# reasons remote inadmissible
why=collections.Counter()
for d in dec.values():
    for p in d['predictions']:
        if p['path']=='remote' and not p['admissible']:
            why['remote tpot>%d'%(p['tpot_ms']//10*10) if p['tpot_ms']>tpot else 'remote ttft']+=1
print(why.most_common(8))
