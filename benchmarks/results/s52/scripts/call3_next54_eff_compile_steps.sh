# (s52 call 3, ~4.5 min, nvidia-h200, carry [".device"]; timeout_s 340)
# #14 JAX EfficientNet-B0: does `noise_split="steps"` compile as AMP's step? (On ResNet-18, s52 call 1: 17.2-21.4 s
# against the default's 23.9-24.1 s and AMP's 16.1-18.1 s.) One cold epoch on 2,048 images each, AMP bs 512 first,
# then triaccel with the steps split; `jit(train_body)` seconds.
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 150 python3 -m examples.cifar.train --backend jax \
  --model efficientnet_b0 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 --test-subset 500 \
  --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/$name.log)" >> $O/table.txt; }
one amp512 --method amp --batch 512; one steps --method triaccel --budget 4GiB --set noise_split=steps
cat $O/table.txt; grep -h "train compiles" $O/*.log
