import json,sys,collections
rs=[json.loads(l) for l in open(sys.argv[1])]
tpot=float(sys.argv[2]) if len(sys.argv)>2 else 14.0574
dec={r['request']:r for r in rs if r['kind']=='decision'}
for d in dec.values(): d['at']=d['t']-d['ttft_ms']/1e3
tp={r['request']:r for r in rs if r['kind']=='tpot'}
steps=collections.defaultdict(list)
for r in rs:
    if r['kind']=='step': steps[r['instance']].append(r)
n=0
for k,t in sorted(tp.items(), key=lambda kv: kv[1]['t']):
    if t['tpot_ms']<=tpot: continue
    d=dec[k]; di=d['decode']
    end=t['t']; start=end-t['tpot_ms']/1e3*(t['num_output']-1)
    pre=[s for s in steps[di] if s['t_end']>start and s['t_start']<end and s['num_prefill_tokens']>0]
    placed=[(dd['path'],dd['prompt_len'],round(dd['at'],2)) for dd in dec.values() if dd['prefill']==di and start-2<dd['at']<end and dd['request']!=k]
    print(k,d['path'],di,'dec@%.2f decode %.2f-%.2f'%(d['at'],start,end),'tpot %.1f pred %.1f n=%d'%(t['tpot_ms'],t['predicted_tpot_ms'],t['num_output']),'chunks',len(pre),'%.0fms'%sum((s['t_end']-s['t_start'])*1e3 for s in pre), placed[:5])
    n+=1
    if n>30: break
