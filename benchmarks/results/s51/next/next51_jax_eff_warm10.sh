# (next session, ~8 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 560)
# #14 JAX EfficientNet-B0, seed 0, cold: AMP bs 512, triaccel, triaccel with `t_noise_warm=10` (next50's candidate;
# under the pad floor a bs-96 EfficientNet-B0 step costs the bs-512 program's ~20 ms; torch lost 2.3 points at
# t_noise_warm=25 on this model, s50 call 3, against a 2.4-point surplus over AMP bs 512).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="0" LIMIT=170 timeout 540 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" \
  "warm10=--method triaccel --budget 4GiB --set t_noise_warm=10" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
