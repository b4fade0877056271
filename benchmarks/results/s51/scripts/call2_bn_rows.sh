# (~7 min, nvidia-h200, carry [".device"]; timeout_s 540)
# #14/#15 JAX ResNet-18: the masked BatchNorm's per-layer divides by a traced count (34 of the padded step's 574
# fusions, call 1) replaced by shared row weights (HEAD). First: the step's optimized HLO under HEAD (one epoch of
# 2,048 images, cold) for its fusion counts. Then 10 epochs, cold, seeds 1-2: AMP bs 192, triaccel on HEAD, then
# triaccel with .device/bn_old.patch (the divides back) in the same call.
O=$OUT; mkdir -p $O/hlo $O/new $O/old; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc XLA_FLAGS="--xla_dump_to=/tmp/hd --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_body.*" \
  timeout 90 python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 \
  --no-progress --train-subset 2048 --test-subset 1000 --compile-cache /tmp/hc/jax --out /tmp/runs/hd --method triaccel --budget 4GiB \
  > $O/hlo/tri.log 2>&1; echo "dump rc $?"
gzip -c $(ls /tmp/hd/*train_body*after_optimizations.txt | grep -v buffer | head -1) > $O/hlo/tri-train_body.txt.gz
cd $R
OUT=$O/new MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 250 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/new/jax.log 2>&1
patch -p1 < .device/bn_old.patch
OUT=$O/old MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 150 bash benchmarks/device/jax_variants.sh \
  "triold=--method triaccel --budget 4GiB" > $O/old/jax.log 2>&1
grep "critical" $O/hlo/tri.log | head -2
for m in new old; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
