# (~3.5 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 300)
# #14/#15 JAX, the ResNet-18 step's compilation: triaccel's +4.9 s over AMP's (next67, H100: 24.7 / 19.8 s), where the
# wrapped update alone compiles 4.2x the plain one's with 45 Triton fusions (EfficientNet-B0, 6.45 / 1.52 s).
# 1. XLA's softmax rewriter (reductions feeding broadcasts, as the statistics and the noise norms are) off, both sides.
# 2. Two programs per step (`--fused-step off`: the gradient program on the critical path, the update compiled beside
#    it; s31 measured the gradient program at 16.2 s against AMP's whole step's 18.2 s, steady epochs alike).
# One cold epoch of the demo each (ResNet-18, 2,048 images, own empty caches).
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
S=xla_gpu_enable_softmax_fusion=false
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 100 python3 -m examples.cifar.train \
  --backend jax --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 \
  --test-subset 500 --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 "train compiles" $O/$name.log) wall $(python3 -c "import json;print(json.load(open('/tmp/runs/$name/summary.json'))['wall_seconds'])" 2>/dev/null)" >> $O/table.txt; }
python3 -m examples.cifar.train --backend jax --epochs 1 --data /tmp/data/cifar10-jpeg --train-subset 256 --test-subset 100 \
  --no-progress --out /tmp/runs/warm --method amp > $O/warmup.log 2>&1   # the machine's one-time costs, outside the table
one amp --method amp --batch 192
one tri --method triaccel --budget 4GiB
one tri_S --method triaccel --budget 4GiB --xla-option $S
one amp_S --method amp --batch 192 --xla-option $S
one tri_unfused --method triaccel --budget 4GiB --fused-step off
cat $O/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
