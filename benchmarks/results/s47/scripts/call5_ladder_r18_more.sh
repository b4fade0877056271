# (s47 call 5, nvidia-h200, carry [".device"]; timeout_s 300)
# ResNet-18 seeds 3-5: AMP bs 192, the default, and the ladder without 384 with noise_split=double (call 3: seeds 0-2).
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
L='--set batch_buckets=[12,24,48,96,192,512] --set noise_split=double'
OUT=$O/r18 MODEL=resnet18 SEEDS="3 4 5" LIMIT=40 timeout 250 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trig3d=--method triaccel --budget 4GiB --compile graphs $L" \
  > $O/r18/torch.log 2>&1
for m in r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
