# (s47 call 2, nvidia-h200, carry [".device"]; timeout_s 420)
# #14 EfficientNet-B0, graphed, cold, seeds 0-1: AMP bs 512 L (best and fastest static) beside the default and
# the ladder without 384 (each size AMP never visits costs ~0.3 s: first eager step + capture), with the default
# halves noise split and with "double" (no half-batch shapes): fewer distinct sizes against the climb's steps.
O=$OUT; mkdir -p $O/eff; date -u
L='--set batch_buckets=[12,24,48,96,192,512]'
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=50 timeout 400 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig3=--method triaccel --budget 4GiB --compile graphs $L" \
  "trig3d=--method triaccel --budget 4GiB --compile graphs $L --set noise_split=double" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
