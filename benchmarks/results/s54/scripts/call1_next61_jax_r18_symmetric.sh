# (next session: ~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX ResNet-18, seeds 4-5, 10 epochs cold: AMP bs 192 with its evaluation compiled after its first compilation
# (SplitStep without a TriAccel, since 2026-12-07; s53 call 2 had it on AMP's critical path, call 3 beside its first
# compilation), the default (noise_split="steps", rows on both sides of the noise step since 2026-12-07) and the halves.
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="4 5" LIMIT=80 timeout 560 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "halves=--method triaccel --budget 4GiB --set noise_split=halves" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
