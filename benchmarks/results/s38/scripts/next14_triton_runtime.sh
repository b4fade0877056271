# (next session, ~7 min, nvidia-h200, carry [".device"]; copy to .device/ first) #14: torch, both sides
# --compile graphs, seeds 0-1, every run cold: --triton-warmup on (the default: Triton's start-up and the kernel's
# compilation on a thread) against --triton-warmup runtime (only the start-up on the thread, the kernel compiled
# on the main thread at the end of the set-up), beside the graphed statics. Make the faster one the default.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "trigr=--method triaccel --budget 4GiB --compile graphs --triton-warmup runtime" > $O/r18/torch.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=100 WARMUP=0 bash benchmarks/device/torch_variants.sh \
  "amp512g=--method amp --batch 512 --compile graphs" "trigw=--method triaccel --budget 4GiB --compile graphs" \
  "trigr=--method triaccel --budget 4GiB --compile graphs --triton-warmup runtime" > $O/eff/torch.log 2>&1
for d in r18 eff; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/torch.log | grep "acc\|wall_s\|rror\|warm-up" | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
