# (next session, ~9 min, nvidia-h200, carry [".device"]) #14 JAX with the statistics stacked by length (52cfb71):
# cold runs after the warm-up process, ResNet-18 seeds 0-1 (AMP bs 192 against triaccel), then EfficientNet-B0
# seed 0 (AMP bs 512 against triaccel). Before: ResNet-18 1.12x on the mean of 4 seeds, EfficientNet-B0 1.12x / 1.21x.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=150 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/r18/jax.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=220 WARMUP=0 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" > $O/eff/jax.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/jax.log | grep "acc\|wall_s\|critical\|rror\|warm-up" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
