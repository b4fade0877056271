# (next session, first: ~8 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX EfficientNet-B0, seed 0, 10 epochs cold: AMP bs 512, triaccel (the JAX demo's default since s52:
# noise_split="steps"; its step compiled 1.178x AMP's, s52 call 3) and the old default (--set noise_split=halves).
# The warm-up process runs ResNet-18 (demo_variants.sh's WARMUP_MODEL; an EfficientNet-B0 warm-up took ~2 min).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="0" LIMIT=175 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" \
  "halves=--method triaccel --budget 4GiB --set noise_split=halves" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
