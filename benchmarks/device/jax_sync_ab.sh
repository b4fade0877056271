# What elastic_step's per-micro-batch wait costs the JAX demo: each method with and without it
# (benchmarks/device/jax_nosync_demo.py), 3 epochs, seed 0, each run on its own compile cache.
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_sync_ab.sh
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs
one() { name=$1; shift; timeout 170 python3 "$@" --backend jax --model resnet18 --epochs 3 --data $D --seed 0 --no-progress --compile-cache /tmp/cc/$name --out /tmp/runs/$name > $OUT/$name.log 2>&1; python3 -c "
import json,sys; s=json.load(open('/tmp/runs/$name/summary.json')); print('$name', [round(x,2) for x in s['epoch_seconds']], s['final_acc'], s.get('final_batch'))"; }
for m in "amp --batch 192" "amp --batch 384" "triaccel --levers precision --batch 384 --batch-max 384"; do
  tag=$(echo $m | tr -d ' -' | cut -c1-20)
  one ${tag}-sync -m examples.cifar.train --method $m
  one ${tag}-nosync benchmarks/device/jax_nosync_demo.py --method $m
done
