# (next session: ~6 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 450)
# #14 JAX ResNet-18, seeds 1-2, 10 epochs cold: where the climb's cost goes under the pad floor. Every batch below
# 512 runs the bs-512 program (7.1 ms a step), so the demo's start at bs 96 makes epoch 1 ~3.7 s of stepping
# against AMP bs 192's ~1.1 s, and a seed whose estimate stays under 192 keeps 2.0 s epochs (s52 call 1, seed 2).
# Variants (diagnostic, not defaults): the default (steps split), the same from bs 192 (the user's batch, the LR at
# it as the demo's rule gives), and batch_growth=jump (one decision to the top rung the bound allows).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 430 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "tri192=--method triaccel --budget 4GiB --batch 192" \
  "jump=--method triaccel --budget 4GiB --set batch_growth=jump" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
