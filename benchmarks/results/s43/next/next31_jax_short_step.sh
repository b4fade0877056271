# (next session, ~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560, block 530 s)
# #14 JAX ResNet-18, cold, seed 0: the short-step weight on the GPU (the fused step program takes it as an
# argument since s42; CPU-tested only). triaccel's default (weighted) against --set short_step_lr=batch, and
# AMP bs 192 (the demo's static runs keep "batch"), one call, so the walls compare.
O=$OUT; mkdir -p $O/jax; date -u
OUT=$O/jax MODEL=resnet18 SEEDS=0 LIMIT=170 timeout 530 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "triB=--method triaccel --budget 4GiB --set short_step_lr=batch" > $O/jax/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax/jax.log | grep "acc\|wall_s\|critical\|rror" | head -20
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
