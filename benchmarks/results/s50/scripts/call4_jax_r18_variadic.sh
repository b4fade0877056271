# (~6 min, nvidia-h200, carry [".device"]; timeout_s 420)
# #14 JAX ResNet-18, cold, 10 epochs, seeds 1-2: AMP bs 192 and triaccel on HEAD, then triaccel with
# .device/variadic.patch (the per-array statistics as one variadic reduce: call 2 cut the EfficientNet-B0 update's
# compilation 8.68 -> 7.22 s and its call 5.79 -> 4.92 ms).
O=$OUT; mkdir -p $O/head $O/var; date -u
OUT=$O/head MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 250 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/head/jax.log 2>&1
patch -p1 < .device/variadic.patch
OUT=$O/var MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 150 bash benchmarks/device/jax_variants.sh \
  "trivar=--method triaccel --budget 4GiB" > $O/var/jax.log 2>&1
for m in head var; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
