# (s43 call 4, nvidia-h200, carry [".device"], timeout_s 560)
# #14: t_noise_warm=10 (rung growth) on the seeds call 3 left out, and t_noise=200 after the warm-up (fewer
# steady noise steps, each a split step and a host read: the steady epochs' ~3% against AMP bs 512), graphed, cold.
# EfficientNet-B0 seed 2 (AMP bs 512 L, default, w10, w10 + t_noise 200), seeds 0-1 (AMP bs 512 L, w10 + t_noise
# 200); ResNet-18 seeds 0-2 (AMP bs 192, w10).
O=$OUT; mkdir -p $O/eff2 $O/eff01 $O/r18; date -u
OUT=$O/eff2 MODEL=efficientnet_b0 SEEDS="2" LIMIT=60 timeout 200 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "triw10=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10" \
  "triw10n200=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10 --set t_noise=200" \
  > $O/eff2/torch.log 2>&1
OUT=$O/eff01 MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 190 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "triw10n200=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10 --set t_noise=200" \
  > $O/eff01/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 170 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "triw10=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=10" \
  > $O/r18/torch.log 2>&1
for m in eff2 eff01 r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed 's/setup_phases.*//' | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
