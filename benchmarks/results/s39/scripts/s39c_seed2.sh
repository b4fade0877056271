# (s39 call C, ~5 min, nvidia-h200, carry [".device"]) #14: the noise law's bound c = 2 against c = 1 (the
# default) and AMP under --compile graphs on seed 2, EfficientNet-B0 then ResNet-18, every run cold.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=2 LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" \
  "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "tric2=--method triaccel --budget 4GiB --compile graphs --set noise_scale_c=2" > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS=2 LIMIT=80 WARMUP=0 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "tric2=--method triaccel --budget 4GiB --compile graphs --set noise_scale_c=2" > $O/r18/torch.log 2>&1
for d in eff r18; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|wall_s\|rror\|warm-up" | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
