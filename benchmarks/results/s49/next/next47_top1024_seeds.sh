# (~5 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 400)
# #14 torch: a 1024 rung above 512. B_noise late in training is far above the ladder's top (s48 call 1,
# seed 0, with c = 2: EfficientNet-B0 B_noise 498 at epoch 4 -> 1914 at epoch 10, ResNet-18 355 -> 3184) and
# EfficientNet-B0's peak at 512 is 0.92 GB under the 4 GiB budget: the law would take 1024 if the ladder had
# it. Whether a bs-1024 step is cheaper per sample than bs 512 (AMP static at 1024, also the static sweep's
# next row), and what the default's climb with the rung does to wall and accuracy; seed 0.
O=$OUT; mkdir -p $O/eff $O/r18; date -u
B1024="--batch-max 1024 --set batch_buckets=[12,24,48,96,192,512,1024]"
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=50 timeout 240 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "amp1024gL=--method amp --batch 1024 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig1024=--method triaccel --budget 4GiB --compile graphs $B1024" \
  > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=40 timeout 120 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig1024=--method triaccel --budget 4GiB --compile graphs $B1024" \
  > $O/r18/torch.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40
  for f in $O/$m/s*/*.log; do echo "$f $(grep -o 'batch [0-9]*' $f | tail -1) $(grep -c '^epoch' $f) epochs: $(grep '^epoch' $f | awk '{print $8"@"$10}' | tr '\n' ' ')"; done; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
