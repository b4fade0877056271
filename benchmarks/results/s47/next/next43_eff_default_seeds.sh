# (next session, ~4 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 300)
# torch EfficientNet-B0, graphed, cold: the default (since s47: 96/192/512, noise_split=double) against AMP bs
# 512 L on seeds 3-4 (s47 calls 2-3, seeds 0-2: 1.13 / 1.14 / 1.06x).
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="3 4" LIMIT=50 timeout 270 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -20
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
