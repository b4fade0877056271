# (~4.5 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 330)
# #14/#15 JAX: which XLA GPU pass makes the wrapped update compile 4.2x the plain one's (next67, H100: EfficientNet-B0
# update 6.45 s against 1.52 s, 45 Triton fusions against none) and the ResNet-18 step +4.9 s over AMP's (24.7 / 19.8 s).
# Reductions feeding broadcasts (the statistics, the noise) match XLA's softmax rewriter and its block-level fusions,
# each autotuned. Probe, each flag on both sides: the update alone (EfficientNet-B0 width 1, with the noise halves),
# then one cold epoch of the demo (ResNet-18, 2,048 images, own empty caches).
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
S=xla_gpu_enable_softmax_fusion=false
A=xla_gpu_experimental_enable_fusion_autotuner=false
upd() { name=$1; shift; timeout 120 python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise \
  --variants plain auto --out $O/upd-$name "$@" > $O/update-$name.log 2>&1; echo "== update $name $*"; tail -3 $O/update-$name.log; }
upd default
upd softmax_off --xla-option $S
upd autotuner_off --xla-option $A
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 150 python3 -m examples.cifar.train \
  --backend jax --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 \
  --test-subset 500 --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/$name.log) wall $(python3 -c "import json;print(json.load(open('/tmp/runs/$name/summary.json'))['wall_seconds'])" 2>/dev/null)" >> $O/table.txt; }
python3 -m examples.cifar.train --backend jax --epochs 1 --data /tmp/data/cifar10-jpeg --train-subset 256 --test-subset 100 \
  --no-progress --out /tmp/runs/warm --method amp > $O/warmup.log 2>&1   # the machine's one-time costs, outside the table
one amp --method amp --batch 192
one tri --method triaccel --budget 4GiB
one tri_S --method triaccel --budget 4GiB --xla-option $S
one amp_S --method amp --batch 192 --xla-option $S
one tri_A --method triaccel --budget 4GiB --xla-option $A
cat $O/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
