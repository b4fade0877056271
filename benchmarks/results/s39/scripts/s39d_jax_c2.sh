# (s39 call D, ~7 min, nvidia-h200, carry [".device"]) #14 JAX: the noise law's bound c = 2 against c = 1 (the
# default) and AMP, seed 0, ResNet-18 (AMP bs 192) then EfficientNet-B0 (AMP bs 512), cold runs after the
# warm-up process (the statistics stacked by length, 52cfb71).
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=150 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "tric2=--method triaccel --budget 4GiB --set noise_scale_c=2" > $O/r18/jax.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=200 WARMUP=0 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" \
  "tric2=--method triaccel --budget 4GiB --set noise_scale_c=2" > $O/eff/jax.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/jax.log | grep "acc\|wall_s\|critical\|rror\|warm-up" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
