# s46 call 6: --graph-prewarm on (ShapeWarmup: every graphed size run once on a copy of the model on a thread
# beside the set-up) for both sides, graphed, cold: EfficientNet-B0 seeds 0-1, then ResNet-18 seeds 0-1.
O=$OUT; mkdir -p $O/eff $O/r18; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=45 timeout 250 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "amp512gLP=--method amp --batch 512 --compile graphs --set short_step_lr=linear --graph-prewarm on" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigP=--method triaccel --budget 4GiB --compile graphs --graph-prewarm on" > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=30 timeout 175 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "amp192gP=--method amp --batch 192 --compile graphs --graph-prewarm on" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigP=--method triaccel --budget 4GiB --compile graphs --graph-prewarm on" > $O/r18/torch.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//" | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
