# (next session, ~8 min, nvidia-h200, carry [".device"]) #14 ResNet-18, torch, every run cold and graphed, seeds 0-1:
# AMP bs 192; triaccel's default; batch_growth=jump; the default with kernels="torch" (no Triton in the run: on
# ResNet-18 the set-up did not hide Triton's thread, 2026-11-28); jump with kernels="torch" and the capture variant
# (GV as in next21). The summaries' setup_phases (model, wrapped, flops, triton_wait) say where the set-up goes.
# Run with timeout_s 560 (block 530 s).
O=$OUT; mkdir -p $O/r18; date -u
GV="--graph-warmup eager --graph-caches emptied"
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=55 timeout 530 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "amp192gv=--method amp --batch 192 --compile graphs $GV" \
  "trigv=--method triaccel --budget 4GiB --compile graphs $GV" \
  "trijgv=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump $GV" > $O/r18/torch.log 2>&1
echo "== r18"; grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|wall_s\|rror\|warm-up\|graphs" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
