# (next session, ~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 500, block 470 s)
# #14 torch, graphed, cold: --triton-warmup first-step (Triton's start-up and the statistics kernel's compilation
# on a thread, joined before the first step's update, so that the thread also overlaps that step's eager forward
# and backward) against the default "on" (joined before the first forward). On 2026-11-28 (s42 calls 2-3) the
# wait left after the set-up ("triton_wait") was 0.23-0.53 s (EfficientNet-B0) and 0.42-0.68 s (ResNet-18), the
# triaccel-only part of the set-up. ResNet-18 seeds 0-2 beside AMP bs 192, then EfficientNet-B0 seeds 0-1.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 260 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 200 bash benchmarks/device/torch_variants.sh \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | head -20; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
