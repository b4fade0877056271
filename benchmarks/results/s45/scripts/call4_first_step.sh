# #14 torch graphed, bytecode cached this time (PYTHONDONTWRITEBYTECODE unset, PYTHONPYCACHEPREFIX): the set-up
# without the per-process compilation of torch's modules, and --triton-warmup first-step against the default "on".
O=$OUT; mkdir -p $O/eff $O/r18; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=40 timeout 135 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=50 timeout 225 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigF=--method triaccel --budget 4GiB --compile graphs --triton-warmup first-step" \
  > $O/eff/torch.log 2>&1
for m in r18 eff; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//" | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
