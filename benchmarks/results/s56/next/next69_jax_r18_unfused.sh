# (next session: ~7 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX ResNet-18, seeds 6-7, 10 epochs cold: AMP bs 192, the default (one program per step, the noise halves in
# the update), and the default with --fused-step off (the gradient program on the critical path, the update and the
# noise programs compiled beside it). s56 call 3 (one cold epoch, H100): critical-path compiles 18.2 s against the
# default's 23.2 s and AMP's 17.4 s; wall 22.67 / 26.72 / 22.54 s. What 10 epochs say: the steady bs-512 epochs as
# two programs (s31: 0.76 against 0.77 s), the noise steps on the host path, the 8 background compilations beside
# epoch 1's steps. Same seeds as s56 call 1 (default 1.186 / 1.125x AMP's wall, steps split 1.096 / 1.102x).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="6 7" LIMIT=80 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "unfused=--method triaccel --budget 4GiB --fused-step off" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror\|train compiles" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
