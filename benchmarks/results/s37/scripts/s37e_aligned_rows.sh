# (~6 min) #14: the torch statistics ring's rows 16-byte aligned (one Triton specialisation instead of three in the
# first steps): ResNet-18 seed 0 (AMP bs 192 vs triaccel) and EfficientNet-B0 seed 0 (AMP bs 512 vs triaccel), both
# sides --compile graphs, after a short warm-up run (the machine's first CUDA process pays the driver's set-up).
O=$OUT; mkdir -p $O/warm $O/r18 $O/eff
OUT=$O/warm MODEL=resnet18 SEEDS=9 EPOCHS=1 LIMIT=60 bash benchmarks/device/torch_variants.sh "warm=--method amp --batch 192 --train-subset 4096" > $O/warm/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/eff/torch.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|graphs\|wall_s\|rror" | head -12; grep -h "plots (" $O/$d/s0/*.log; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
