# s38 call D (#14): torch, both sides --compile graphs, seeds 0-1, every run cold (Triton's and inductor's caches
# emptied): triaccel with --triton-warmup on (the default: Triton's start-up and the kernel on a thread) against
# --triton-warmup process (the kernel compiled by a child process started before the data loads), beside the
# graphed static (ResNet-18: AMP bs 192; EfficientNet-B0: AMP bs 512).
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "trigp=--method triaccel --budget 4GiB --compile graphs --triton-warmup process" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=100 WARMUP=0 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "trigp=--method triaccel --budget 4GiB --compile graphs --triton-warmup process" > $O/eff/torch.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|wall_s\|rror\|warm-up\|child" | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
