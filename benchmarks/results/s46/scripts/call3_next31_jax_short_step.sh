# (next session, ~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560, block 530 s)
# #14 JAX ResNet-18, cold, seed 0, one call so the walls compare:
# - the short-step weight on the GPU (the fused step program takes it as an argument since s42; CPU-tested only):
#   triaccel's default (weighted) beside AMP bs 192 (the demo's static runs keep "batch");
# - t_noise_warm=10 (s43: the noise EMA warm at step 140, first growth at 150 instead of 350). Under JAX the bs-96
#   steps are padded to the 512 program (~7.9 ms against AMP bs 192's ~4.1 ms per step, 2026-11-28), so each
#   bs-96 step the law skips saves more than under torch: ~200 fewer padded steps, ~1.3 s expected.
O=$OUT; mkdir -p $O/jax; date -u
OUT=$O/jax MODEL=resnet18 SEEDS=0 LIMIT=170 timeout 530 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "triW=--method triaccel --budget 4GiB --set t_noise_warm=10" > $O/jax/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax/jax.log | grep "acc\|wall_s\|critical\|rror" | head -20
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
