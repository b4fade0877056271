# (next session: ~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX ResNet-18, seeds 6-7, 10 epochs cold: AMP bs 192 (evaluation compiled after its step), the default
# (the halves again since 8fdc918), the default with --compile-ahead after (the evaluation held until the step's
# first compilation ends, as AMP's: s54 call 1's gap was that compilation, +4.0-5.8 s, with the evaluation
# compiling beside it), and noise_split=steps (the JAX default of 2026-12-04 to 12-07, faster on this model).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="6 7" LIMIT=80 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "after=--method triaccel --budget 4GiB --compile-ahead after" \
  "steps=--method triaccel --budget 4GiB --set noise_split=steps" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
