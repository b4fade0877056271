# (next session: ~7 min, right after next69 on its warm machine, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX EfficientNet-B0 seed 1 (s54's next65 with s56's question), 10 epochs cold: AMP bs 512, the default, the
# default with --fused-step off. EfficientNet-B0 has 213 parameter arrays: as two programs the gradients travel as
# 213 buffers between them (the state is packed, the gradients are not; a call costs the host per buffer), where s31
# s32 (2026-11-27, H200, after the state was packed, the moments then a jax-triton custom call) saw two programs per
# step at 2.0-3.0 s per steady epoch against AMP's 1.1 s: if they are still slow, the way out is to start with two
# programs and switch to the fused one once the background thread has compiled it (not built; s56 README).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="1" LIMIT=180 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" \
  "unfused=--method triaccel --budget 4GiB --fused-step off" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror\|train compiles" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
