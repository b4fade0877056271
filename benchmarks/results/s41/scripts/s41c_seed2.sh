# (session 41, ~5 min) seed 2 of the candidate defaults (batch_growth=jump, each size's first step eager, caches emptied)
# against AMP with the same capture recipe, both torch models, graphed, cold. Run with timeout_s 330.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
GV="--graph-warmup eager --graph-caches emptied"
OUT=$O/r18 MODEL=resnet18 SEEDS="2" LIMIT=50 timeout 140 bash benchmarks/device/torch_variants.sh \
  "amp192gv=--method amp --batch 192 --compile graphs $GV" \
  "trijgv=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump $GV" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="2" LIMIT=60 timeout 160 bash benchmarks/device/torch_variants.sh \
  "amp512gv=--method amp --batch 512 --compile graphs $GV" \
  "trijgv=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump $GV" > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | head -8; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
