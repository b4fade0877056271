# (~6 min) #14, torch, both sides --compile graphs, seed 0, one call (demo_variants.sh runs its warm-up process first;
# every run cold: inductor's and Triton's caches emptied): triaccel as now (trig), with the noise halves run eagerly
# (trigoff: --graph-halves off), and with Triton's start-up on a thread during set-up (trigw: --triton-warmup on),
# beside the graphed static (ResNet-18: AMP bs 192; EfficientNet-B0: AMP bs 512). Decide both defaults from the walls.
O=$OUT; mkdir -p $O/r18 $O/eff
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigoff=--method triaccel --budget 4GiB --compile graphs --graph-halves off" \
  "trigw=--method triaccel --budget 4GiB --compile graphs --triton-warmup on" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=100 WARMUP=0 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigoff=--method triaccel --budget 4GiB --compile graphs --graph-halves off" \
  "trigw=--method triaccel --budget 4GiB --compile graphs --triton-warmup on" > $O/eff/torch.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|graphs\|wall_s\|rror\|warm-up" | head -16; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
