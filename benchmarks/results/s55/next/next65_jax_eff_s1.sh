# (next session: ~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX EfficientNet-B0 seed 1, 10 epochs cold: AMP bs 512 and the default (the halves again since 8fdc918).
# s54 calls 2/4 (seed 0): the steps split 1.027x AMP's wall at 71.65% (a loss jump at step 509) against 72.68%, the
# halves 1.032x at 76.88%. next66 runs the steps split and the default with --compile-ahead after on the same warm
# machine right after (start it within 30 s).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="1" LIMIT=180 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
