# (next session, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560)
# #14 JAX EfficientNet-B0, cold, seed 0: AMP bs 512 (its best and fastest static under JAX, 2026-11-27) beside the
# default (the short-step weight on the GPU since s42, last measured there on 2026-11-28: 1.12x / 1.21x on seeds
# 0 / 1). The JAX standing of #14 on its second model with today's code.
O=$OUT; mkdir -p $O/jax; date -u
OUT=$O/jax MODEL=efficientnet_b0 SEEDS=0 LIMIT=260 timeout 530 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" > $O/jax/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax/jax.log | grep "acc\|wall_s\|critical\|rror" | head -20
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
