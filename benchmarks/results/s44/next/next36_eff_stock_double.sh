# (next session, second call, ~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 520)
# The same two options as next35 on EfficientNet-B0 seeds 0-1 beside AMP bs 512 L (its best and fastest static,
# with the short-step weight): each capture AMP does not make showed as a 0.37-0.49 s host gap there (s39 call C); the
# default stood at 1.23-1.26x AMP bs 512 L's wall (s43 calls 1, 3, 4; 75.14 / 76.20% on seeds 0 / 1).
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 480 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigS=--method triaccel --budget 4GiB --compile graphs --set kernels=stock" \
  "trigSD=--method triaccel --budget 4GiB --compile graphs --set kernels=stock --set noise_split=double" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror\|graphs" | sed 's/setup_phases.*//' | head -30
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
