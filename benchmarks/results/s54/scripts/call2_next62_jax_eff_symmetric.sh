# (next session: ~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14 JAX EfficientNet-B0 seed 0, 10 epochs cold: AMP bs 512 (evaluation compiled after its first compilation), the
# default (the steps split with rows on both sides) and the halves. s53 call 1 (the after-only steps split, AMP's
# evaluation on its critical path): steps 1.138x, halves 1.079x AMP's wall; call 3: the steps split's estimate was
# missing at the 11 boundaries from step 200 to 700 and the batch stayed at 96 for two epochs. Read each run's
# summary's compiled_ahead_unused: call 1's steps run compiled a foreseen precision policy's step (21.6 s) beside
# epochs 2-10 and never used it; since 2026-12-07 foreseen policies are not compiled ahead (SplitStep foresee_policies).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=efficientnet_b0 SEEDS="0" LIMIT=180 timeout 570 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" \
  "halves=--method triaccel --budget 4GiB --set noise_split=halves" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
