# s38 call B: JAX statistics with small arrays stacked by length (working tree) against one reduction per
# array (HEAD, .device/old_grad_moments.py); ResNet-18 bs 96, triaccel-fixed vs AMP, interleaved rounds.
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
date -u; git -C $R log --oneline -1 2>/dev/null
NEW=$R/kernels/grad_moments.py; OLD=$R/.device/old_grad_moments.py; K=/tmp/pkg/triaccel/kernels/grad_moments.py
for v in old new; do
  if [ $v = old ]; then cp $OLD $K; else cp $NEW $K; fi
  for m in resnet18 efficientnet_b0; do
    timeout 200 python3 benchmarks/jax_update_compile.py --model $m --width 1 --variants plain auto > $OUT/upd-$v-$m.log 2>&1
    echo "== update $v $m rc $?"; grep -v "^W1\|Warning\|^ *$" $OUT/upd-$v-$m.log | tail -5
  done
done
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs; B=96
one() { name=$1; v=$2; shift 2
  if [ $v = old ]; then cp $OLD $K; else cp $NEW $K; fi
  timeout 200 python3 -m examples.cifar.train --backend jax --model resnet18 --data $D --seed 0 --no-progress \
    --epochs 3 --batch $B --compile-cache /tmp/cc/${name%-r*} --out /tmp/runs/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc $?"; cp /tmp/runs/$name/log.jsonl $OUT/$name.jsonl
  python3 -c "
import json; s=json.load(open('/tmp/runs/$name/summary.json')); e=s['epoch_seconds']
print(f\"{'$name':<12} acc {s['final_acc']:.4f} train_s {sum(e):.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in e]}\")"; }
for r in 1 2 3 4 5; do
  one amp-r$r new --method amp
  one old-r$r old --method triaccel --levers precision --batch-max $B
  one new-r$r new --method triaccel --levers precision --batch-max $B
done
python3 benchmarks/device/step_gaps.py $OUT/*.jsonl --epochs 3 > $OUT/gaps.txt 2>&1
python3 - <<'PY'
import json, glob, os, statistics
out = os.environ["OUT"]
def ep(name): return json.load(open(f"/tmp/runs/{name}/summary.json"))["epoch_seconds"]
def med(name, e):
    st = [json.loads(l) for l in open(f"{out}/{name}.jsonl")]
    st = [s for s in st if s.get("type") == "step" and s["epoch"] == e]
    g = sorted(b["host_s"] - a["host_s"] for a, b in zip(st, st[1:]))
    return g[len(g)//2] * 1e3 if g else float("nan")
tot = {k: 0.0 for k in ("amp", "old", "new")}; meds = {k: [] for k in tot}
for r in range(2, 6):
    row = []
    for k in tot:
        try: e = ep(f"{k}-r{r}"); tot[k] += e[1] + e[2]; meds[k] += [med(f"{k}-r{r}", 1), med(f"{k}-r{r}", 2)]; row.append(f"{k} {e[1]:.2f}+{e[2]:.2f}")
        except Exception as x: row.append(f"{k} ? {x}")
    print(f"round {r}: " + " | ".join(row))
print("sums epochs 2-3 (rounds 2-5):", {k: round(v, 2) for k, v in tot.items()}, "old/amp", round(tot["old"]/tot["amp"], 3), "new/amp", round(tot["new"]/tot["amp"], 3))
print("median of median step gaps ms:", {k: round(statistics.median(v), 3) for k, v in meds.items() if v})
PY
cd $OUT && tar czf all.tgz --remove-files -- *.log *.jsonl gaps.txt 2>/dev/null; ls $OUT
