# (~8 min, nvidia-h200, carry [".device"]; timeout_s 480) s48's next45 as it was:
# torch, graphed, cold, seeds 3-5 (ResNet-18) / 3-4 (EfficientNet-B0): the default against --set t_noise_warm=25
# (s48 call 1, seeds 0-2: ResNet-18 0.969x against 0.990x AMP bs 192's wall summed, EfficientNet-B0 1.107x
# against 1.115x AMP bs 512 L's). A default only if both models keep the gain on these seeds too.
O=$OUT; mkdir -p $O/eff $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="3 4 5" LIMIT=40 timeout 210 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigw25=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=25" \
  > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="3 4" LIMIT=50 timeout 240 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigw25=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=25" \
  > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
