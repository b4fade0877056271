# (s43 call 3, nvidia-h200, carry [".device"], timeout_s 560)
# #14: t_noise_warm (the first 5 noise measurements every 10 steps from step 100, so the noise EMA is warm at
# step 140 instead of 300) with rung and jump growth, against the default and the best static, graphed, cold.
# EfficientNet-B0 seeds 0-1 beside AMP bs 512 (short step weighted like triaccel's), ResNet-18 seeds 0-1 beside
# AMP bs 192 (its best static).
O=$OUT; mkdir -p $O/eff $O/r18; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 360 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "triw10=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10" \
  "triw10j=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10 --set batch_growth=jump" \
  > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=45 timeout 170 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "triw10j=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10 --set batch_growth=jump" \
  > $O/r18/torch.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed 's/setup_phases.*//' | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
