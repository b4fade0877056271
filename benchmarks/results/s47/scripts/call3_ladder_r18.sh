# (s47 call 3, nvidia-h200, carry [".device"]; timeout_s 480)
# The ladder without 384 with noise_split=double ("trig3d", call 2: EfficientNet-B0 1.13-1.14x AMP bs 512 L
# against the default's 1.22-1.23x) on ResNet-18 seeds 0-2 beside AMP bs 192 and the default, and on
# EfficientNet-B0 seed 2.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
L='--set batch_buckets=[12,24,48,96,192,512] --set noise_split=double'
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=40 timeout 250 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig3d=--method triaccel --budget 4GiB --compile graphs $L" \
  > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="2" LIMIT=50 timeout 170 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig3d=--method triaccel --budget 4GiB --compile graphs $L" \
  > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
