# (next session, ~8 min, nvidia-h200, carry [".device"]) #14: ResNet-18 torch graphed, batch_growth=jump against
# the rung climb (c = 2), AMP bs 192 beside, seeds 0-1; then JAX ResNet-18 seed 0, c = 2 (the default since
# f7f4981) against c = 1 and AMP bs 192 (s39 call D lost these: it ran past its limit before packing; each block
# now has its own timeout so that the last line packs whatever ran; run with timeout_s 595).
O=$OUT; mkdir -p $O/r18 $O/jax; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="0 1" LIMIT=80 timeout 250 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trij=--method triaccel --budget 4GiB --compile graphs --set batch_growth=jump" > $O/r18/torch.log 2>&1
OUT=$O/jax MODEL=resnet18 SEEDS=0 LIMIT=110 WARMUP=0 timeout 300 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tric2=--method triaccel --budget 4GiB" \
  "tric1=--method triaccel --budget 4GiB --set noise_scale_c=1" > $O/jax/jax.log 2>&1
for d in r18 jax; do echo "== $d"; grep -v "^W1\|Warning" $O/$d/*.log | grep "acc\|wall_s\|critical\|rror\|warm-up" | head -24; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
