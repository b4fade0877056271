# (next session, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560, block 530 s)
# #14 torch, graphed, cold: Triton's start-up against the set-up. On 2026-11-28 (s43 calls 1, 3, 4) triaccel's
# set-up to "arrays" averaged 5.39 s over 24 runs against AMP's 4.74 s over 12 ("model" 0.39-0.65 s against
# 0.24-0.52 s), then its "flops" phase and the Triton wait 0.13-0.55 s: ~1-1.5 s more, most likely the Triton
# thread competing with the set-up for the interpreter. Variants: the default "on" (thread joined before the first
# forward), "first-step" (joined before the first step's update) and "off" (Triton starts at its first launch, on
# the caller's thread). ResNet-18 seeds 0-2 beside AMP bs 192, then EfficientNet-B0 seeds 0-1. Compare
# setup_phases and wall_s within the call.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 300 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  "trigO=--method triaccel --budget 4GiB --compile graphs --triton-warmup off" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 220 bash benchmarks/device/torch_variants.sh \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  "trigO=--method triaccel --budget 4GiB --compile graphs --triton-warmup off" > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | head -30; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
