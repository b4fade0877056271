# (s52 call 2, ~9 min, nvidia-h200, carry [".device"]; timeout_s 590)
# #14 JAX: `noise_split="steps"` on more seeds and on the second model. Call 1 (seeds 1-2): walls 0.912x / 1.119x
# AMP bs 192's, compile 17.2 / 21.4 s against tri's 24.1 / 23.9 s. Here ResNet-18 seeds 3-4 (AMP bs 192, steps)
# and EfficientNet-B0 seed 0 (AMP bs 512, steps), cold.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="3 4" LIMIT=80 timeout 200 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "steps=--method triaccel --budget 4GiB --set noise_split=steps" > $O/r18/jax.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0" LIMIT=170 timeout 350 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "steps=--method triaccel --budget 4GiB --set noise_split=steps" > $O/eff/jax.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
