# (~5 min) #14, torch, both sides --compile graphs, seed 0, one call (demo_variants.sh runs its warm-up process first):
# triaccel with the noise halves captured (--graph-halves on, the default) against run eagerly (off), beside the
# graphed static (ResNet-18: AMP bs 192; EfficientNet-B0: AMP bs 512). Decide the default from the process walls.
O=$OUT; mkdir -p $O/r18 $O/eff
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigoff=--method triaccel --budget 4GiB --compile graphs --graph-halves off" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=100 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigoff=--method triaccel --budget 4GiB --compile graphs --graph-halves off" > $O/eff/torch.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|graphs\|wall_s\|rror\|warm-up" | head -14; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
