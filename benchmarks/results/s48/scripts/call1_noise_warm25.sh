# (next session, ~9 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 560)
# The bs-96 phase (350 steps: warmup_steps 100 + the noise EMA's 5 measurements 50 steps apart) is the largest
# part of EfficientNet-B0's remaining gap under the new default (s47 calls 2-3: 1.06-1.14x). t_noise_warm=25
# takes the first 5 measurements 25 steps apart (growth possible from step 225); s43 measured 10 (EfficientNet-B0
# 1-5% shorter, ResNet-18 0.2-0.4 points lower). Both models, seeds 0-2, against AMP and the default in one call.
O=$OUT; mkdir -p $O/eff $O/r18; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1 2" LIMIT=50 timeout 330 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigw25=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=25" \
  > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=40 timeout 210 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigw25=--method triaccel --budget 4GiB --compile graphs --set t_noise_warm=25" \
  > $O/r18/torch.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
