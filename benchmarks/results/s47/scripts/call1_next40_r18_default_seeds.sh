# (next session, FIRST call, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 470)
# #14 torch ResNet-18, graphed, cold, bytecode cached: the default (since s46 --triton-warmup auto = first-step)
# beside AMP bs 192 on seeds 0-5 in one call. s46 call 1: 0.99 / 1.01 / 1.01 / 0.97x on seeds 0-3 (mean 1.00x):
# at the bound; six seeds in one call say whether the mean is under it.
O=$OUT; mkdir -p $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2 3 4 5" LIMIT=40 timeout 440 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  > $O/r18/torch.log 2>&1
echo "== r18"; grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
