# (next session, ~9 min, nvidia-h200, carry [".device"]; after next20) #14 EfficientNet-B0, torch, every run cold and
# graphed, seeds 0-1: AMP bs 512; triaccel's default (rung climb, c = 2, torch's capture recipe, the Triton
# statistics kernel); batch_growth=jump; jump with kernels="torch" (no Triton in the run: its start-up and
# compilation gone, the demo starts no Triton thread) and the capture variant next20 finds cheapest (here each
# shape's first step eager, caches kept: edit GV if next20 says otherwise). The summaries' setup_phases say where
# the set-up goes. Run with timeout_s 590 (block 560 s).
O=$OUT; mkdir -p $O/eff; date -u
GV="--graph-warmup eager --graph-caches emptied"
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=65 timeout 560 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "amp512gv=--method amp --batch 512 --compile graphs $GV" \
  "trijgv=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump $GV" > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror\|warm-up\|graphs" | head -30
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
