# (next session, FIRST call, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560)
# #14/#15 torch, graphed, cold, ResNet-18 seeds 0-2 beside AMP bs 192 (its best static), two options built on
# 2026-12-01 without a GPU (CPU-tested only):
#  - --set kernels=stock: the statistics from torch's multi-tensor kernels (triaccel.kernels.StockMoments): no
#    Triton kernel launched, so no Triton start-up (cache key, driver, the kernel's cold compilation: ~2.5 s of
#    host time one after the other, partly hidden on the warm-up thread; triaccel's set-up was ~1-1.5 s longer
#    than AMP's on the mean on 2026-11-28, s43);
#  - --set noise_split=double: a noise step takes 2B samples as two micro-batches of B (no half-size shapes: the
#    captures of 48 and 256 go; six sizes' captures summed to 0.825 s on ResNet-18, 2026-11-28 s41 capture_cost).
# Graphed ResNet-18 stood at 0.95-1.18x AMP bs 192's wall with training 0.94-1.02x (s41-s43). First the kernel
# benchmark: StockMoments' GPU and host time beside FixedMoments' and _foreach_norm's. Compare wall_s, setup_s,
# setup_phases (arrays, triton_wait), train_s within a seed, accuracy against the default's (87.44-87.48% on
# seeds 0-1, 87.41% on seed 2 with the same code path otherwise).
O=$OUT; mkdir -p $O/k $O/r18; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 150 python3 benchmarks/kernels.py --no-jax --out $O/k/kernels.json > $O/k/kernels.log 2>&1; echo "kernels rc $?"
grep -E "StockMoments|FixedMoments out=, found_inf|_foreach_norm  |grad_moments list out=|check .*Stock" $O/k/kernels.log
cd $R
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 330 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigS=--method triaccel --budget 4GiB --compile graphs --set kernels=stock" \
  "trigSD=--method triaccel --budget 4GiB --compile graphs --set kernels=stock --set noise_split=double" \
  > $O/r18/torch.log 2>&1
echo "== r18"; grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|wall_s\|rror\|graphs" | sed 's/setup_phases.*//' | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
