# (s42, nvidia-h200, carry [".device"], timeout_s 560) #14 EfficientNet-B0, torch, graphed, cold, seeds 0-2: a short
# step's gradient weighted by its samples (--set short_step_lr=linear: x s/B, the update the linear rule gives
# s samples) for the static AMP bs 512 baseline, triaccel's default and batch_growth=jump. On 2026-11-28 (s41
# callG) jump lost seed 2 (61.83%) at epoch 1's 16-sample last step taken at the 512-sample LR.
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1 2" LIMIT=60 timeout 520 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trigL=--method triaccel --budget 4GiB --compile graphs --set short_step_lr=linear" \
  "trijL=--method triaccel --budget 4GiB --compile graphs --set short_step_lr=linear --set batch_growth=jump" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
