# (next session, FIRST call, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 480)
# #14 torch ResNet-18, graphed, cold, bytecode cached (prep.sh since s45): --triton-warmup first-step against the
# default "on" beside AMP bs 192, seeds 0-3. s45 call 4: first-step hid the Triton wait in all three runs (0.16 s,
# 0, 0 against the default's 1.00 / 0.34 / 0.24 s) and was -2.5 / -1.7 / +1.4 s on three pairs (two models); the
# host's speed varies ~15% from run to run here (steps 5-99 of EfficientNet-B0 0.56-0.66 s for the same work), so
# more pairs decide. Make first-step the default only if its wall is lower on most pairs and its mean lower.
O=$OUT; mkdir -p $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2 3" LIMIT=40 timeout 440 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  > $O/r18/torch.log 2>&1
echo "== r18"; grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
