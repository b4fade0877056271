# (next session, second call, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560)
# The same A/B as next38 on EfficientNet-B0, seeds 0-2, beside AMP bs 512 L (its best and fastest static). s45
# call 4 (bytecode cached): the default 1.16 / 1.25x AMP L's wall on seeds 0 / 1, first-step 1.08 / 1.32x.
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1 2" LIMIT=50 timeout 520 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
