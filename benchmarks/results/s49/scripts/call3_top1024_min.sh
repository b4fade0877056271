# (~3 min, nvidia-h200, carry [".device"]; timeout_s 200) call3_top1024.sh cut to what 215 s of device time hold:
# EfficientNet-B0 seed 0, AMP static bs 1024 and the default with a 1024 rung (against s48 call 1's seed 0).
O=$OUT; mkdir -p $O/eff; date -u
B1024="--batch-max 1024 --set batch_buckets=[12,24,48,96,192,512,1024]"
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=50 timeout 170 bash benchmarks/device/torch_variants.sh \
  "amp1024gL=--method amp --batch 1024 --compile graphs --set short_step_lr=linear" \
  "trig1024=--method triaccel --budget 4GiB --compile graphs $B1024" > $O/eff/torch.log 2>&1
grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
for f in $O/eff/s*/*.log; do echo "$f: $(grep '^epoch' $f | awk '{print $8"@"$10}' | tr '\n' ' ')"; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
