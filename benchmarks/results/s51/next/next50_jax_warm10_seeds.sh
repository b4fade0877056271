# (next session, ~6 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 420)
# #14 JAX: s51 call 4 (seeds 1-2) had `t_noise_warm=10` at 1.074 / 1.012x AMP bs 192's wall against the default's
# 1.083 / 1.056x, 87.35 / 87.63% against 87.26 / 87.48% (stepping 0.7-2.1 s shorter; walls within the machine's
# +-3 s of compile spread). More seeds before a default: ResNet-18 seeds 3-4 (AMP bs 192, triaccel, warm10);
# EfficientNet-B0 is next51.
O=$OUT; mkdir -p $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="3 4" LIMIT=80 timeout 330 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "warm10=--method triaccel --budget 4GiB --set t_noise_warm=10" > $O/r18/jax.log 2>&1
for m in r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
