# (next session, after next58 if its dump shows fewer kernels: ~6 min, nvidia-h200, carry [".device"]; copy it and
# next/row1024.patch to .device/; timeout_s 480)
# #14/#15 JAX ResNet-18, seeds 1-2, 10 epochs cold: AMP bs 192, triaccel on HEAD (ROW = 0), then triaccel with
# next/row1024.patch (the statistics' large arrays in rows of 1024) in the same call: walls and steady epochs.
O=$OUT; mkdir -p $O/head $O/rows; date -u
OUT=$O/head MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 280 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/head/jax.log 2>&1
patch -p1 < .device/row1024.patch
OUT=$O/rows MODEL=resnet18 SEEDS="1 2" LIMIT=80 WARMUP=0 timeout 160 bash benchmarks/device/jax_variants.sh \
  "rows=--method triaccel --budget 4GiB" > $O/rows/jax.log 2>&1
for m in head rows; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
