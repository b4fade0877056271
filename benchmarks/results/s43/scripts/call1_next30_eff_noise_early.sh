# (next session, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 470, block 440 s)
# #14 EfficientNet-B0, torch, graphed, cold, seeds 0-1, every run with the short-step weight (the default since
# s42; AMP's static run takes it by --set so that its recipe is the same): the noise law's EMA warm sooner.
# On 2026-11-28 (s42 call 1) the default measured B_noise every 50 steps from step 100, was warm after five
# (the first growth at step 350 of epoch 1's ~420-520) and then climbed a rung per 50 steps (96 -> 192 -> 384
# -> 512 by step 450-550); six CUDA-graph captures (96, 48, 192, 384, 512, 256) cost ~2.2 s of its 22.3 s
# training against AMP bs 512's one. Variants: measurements every 25 steps (warm at ~200), and that with
# batch_growth=jump (96 -> the largest rung c x B_noise allows: fewer shapes to capture).
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 440 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trin25=--method triaccel --budget 4GiB --compile graphs --set t_noise=25" \
  "trijn25=--method triaccel --budget 4GiB --compile graphs --set t_noise=25 --set batch_growth=jump" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
