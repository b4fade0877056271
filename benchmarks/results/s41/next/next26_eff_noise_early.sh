# (next session, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first) #14 EfficientNet-B0, torch, graphed,
# cold, seeds 0-2: triaccel's default against the noise estimate warm sooner. On 2026-11-28 (s41 callC/G) the
# default measured B_noise from step 100 every 50 steps (t_noise = t_ctrl), the EMA (noise_beta 0.8: 5 measurements)
# was warm at step ~300 and the first growth came at step ~350 of epoch 1's ~380; B_noise was ~550-660 then,
# above the bound's need (c x B_noise > 512), so growth waited on the EMA alone. Variants: measurements every 25
# steps (warm at ~200; each measurement costs two half steps), and batch_growth=jump with the LR multiplier ramped
# over 150 steps (jump lost seed 2, 61.8%, s41 callG, at epoch 1's 16-sample last step taken at the 512-sample LR).
# Run with timeout_s 470 (block 440 s; ~9 runs x 40 s).
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1 2" LIMIT=60 timeout 440 bash benchmarks/device/torch_variants.sh \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trin25=--method triaccel --budget 4GiB --compile graphs --set t_noise=25" \
  "trijr=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump --set lr_ramp_steps=150" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | head -40
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
