# (next session: right after next65 on its warm machine, ~8 min, carry [".device"]; timeout_s 590)
# #14 JAX EfficientNet-B0 seed 1: noise_split=steps, and the default with --compile-ahead after (its evaluation,
# 16.9 s on s54's machine, compiled after the step's first compilation instead of beside it: s54's step compiled
# +13.4 s over AMP's, s53's +12.7 s), against next65's AMP bs 512 (same machine).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="1" LIMIT=180 timeout 570 bash benchmarks/device/jax_variants.sh \
  "steps=--method triaccel --budget 4GiB --set noise_split=steps" \
  "after=--method triaccel --budget 4GiB --compile-ahead after" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
