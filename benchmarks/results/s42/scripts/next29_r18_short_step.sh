# (s42, nvidia-h200, carry [".device"], timeout_s 480) #14 ResNet-18, torch, graphed, cold, seeds 0-2: a short step's
# gradient weighted by its samples (--set short_step_lr=linear) against the default ("batch": the samples'
# mean at the batch's LR), for the static AMP bs 192 baseline, triaccel's default and batch_growth=jump.
O=$OUT; mkdir -p $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 450 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "amp192gL=--method amp --batch 192 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigL=--method triaccel --budget 4GiB --compile graphs --set short_step_lr=linear" \
  "trijL=--method triaccel --budget 4GiB --compile graphs --set short_step_lr=linear --set batch_growth=jump" \
  > $O/r18/torch.log 2>&1
echo "== r18"; grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|wall_s\|rror" | head -60
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
