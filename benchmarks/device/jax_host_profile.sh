# Issue 15 item 2 (JAX): where the demo's step spends the host's time. The harness's plain loop and the demo's
# AMP at bs 96 (ResNet-18, 3 epochs), the demo's triaccel-fixed under cProfile (the .prof file comes back), and
# the demo's AMP with --fused-step on.   bash benchmarks/device/jax_host_profile.sh   (nvidia-h200, carry [".device"])
# The .prof file (MBs) belongs in ../shared/results/, not in the repository.
source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
timeout 300 python3 benchmarks/harness.py --backend jax --model resnet18 --data $D --epochs 3 --batch-sizes 96 \
  --variants plain amp --profile --top 45 --out /tmp/h > $OUT/harness.log 2>&1; echo "harness rc $?"
cp /tmp/h/runs/*.prof $OUT/ 2>/dev/null; cp /tmp/h/harness.json $OUT/
for f in on; do
 timeout 150 python3 -m examples.cifar.train --backend jax --method amp --epochs 3 --batch 96 --data $D --test-subset 512 \
  --no-progress --fused-step $f --out /tmp/fused-$f > $OUT/amp-fused-$f.log 2>&1; echo "fused $f rc $?"
 python3 -c "import json;d=json.load(open('/tmp/fused-$f/summary.json'));print('amp fused-$f epochs',[round(x,3) for x in d['epoch_seconds']])"
done
tail -70 $OUT/harness.log
