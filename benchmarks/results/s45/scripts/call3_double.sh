# #14 torch graphed, bytecode now cached (PYTHONPYCACHEPREFIX): noise_split=double against the default beside the
# best statics, EfficientNet-B0 seeds 0-1 (AMP bs 512 L) and ResNet-18 seeds 0-2 (AMP bs 192).
O=$OUT; mkdir -p $O/eff $O/r18; date -u
python3 -c "import sys; print('dont_write_bytecode', sys.flags.dont_write_bytecode)"
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 300 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigD=--method triaccel --budget 4GiB --compile graphs --set noise_split=double" \
  > $O/eff/torch.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1 2" LIMIT=45 timeout 230 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigD=--method triaccel --budget 4GiB --compile graphs --set noise_split=double" \
  > $O/r18/torch.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/torch.log | grep "acc\|wall_s\|rror\|graphs" | sed 's/setup_phases.*//;s/process_s.*steps/steps/' | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
