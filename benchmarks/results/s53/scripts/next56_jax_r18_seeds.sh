# (next session: ~5 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 400)
# #14 JAX ResNet-18 with the new default (noise_split="steps"), seeds 4-6, 10 epochs cold, against AMP bs 192
# (s52: seeds 1-3 0.912 / 1.119 / 1.036x; seed 4's run was cut before its summary).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="4 5 6" LIMIT=80 timeout 380 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
