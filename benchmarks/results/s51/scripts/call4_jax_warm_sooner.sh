# (~8 min, nvidia-h200, carry [".device"]; timeout_s 560)
# #14 JAX ResNet-18: under the pad floor a bs-96 step costs the bs-512 program's time (call 1: 7.08 ms against 2.45
# in a scan), so the noise EMA's warm-up (5 measurements, every 50 steps from step 100: growth from ~step 350) is
# dearer in JAX than in torch. The same call, cold, 10 epochs, seeds 1-2: AMP bs 192, triaccel, and triaccel with
# the first five noise measurements every 25 / 10 steps (`t_noise_warm`; torch graphed: -0.07 points at 25 on
# ResNet-18, -2.3 on EfficientNet-B0, s50 call 3).
O=$OUT; mkdir -p $O; date -u
OUT=$O MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 540 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "warm25=--method triaccel --budget 4GiB --set t_noise_warm=25" "warm10=--method triaccel --budget 4GiB --set t_noise_warm=10" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
