# (next session, ~2 min, nvidia-h200, carry [".device"]) The ResNet-18 triaccel runs' step 0 records the same loss
# (2.318603515625) on seeds 0 and 1 under --compile graphs (s38 calls A, D, E); AMP's and EfficientNet-B0's differ by
# seed. Two epochs' first steps, seeds 0 and 1, graphed and eager, triaccel and AMP at bs 96: which runs repeat it?
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; D=/tmp/data/cifar10-jpeg
for c in graphs off; do for m in triaccel amp; do for s in 0 1; do
  timeout 120 python3 -m examples.cifar.train --backend torch --model resnet18 --data $D --seed $s --epochs 1 \
    --train-subset 9600 --test-subset 500 --no-progress --method $m --batch 96 --budget 4GiB --compile $c \
    --out /tmp/runs/$c-$m-$s > $OUT/$c-$m-$s.log 2>&1
  python3 -c "
import json; r=[json.loads(l) for l in open('/tmp/runs/$c-$m-$s/log.jsonl')]; st=[x for x in r if x.get('type')=='step'][:3]
print('$c $m seed $s', [(x['loss'], x['batch_size']) for x in st])"
done; done; done
