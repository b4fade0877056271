# s53 call 3 (nvidia-h100-x1, carry [".device"], timeout_s 595): the JAX static baseline with its evaluation compiled
# ahead as triaccel's is (SplitStep without a TriAccel queues its bound functions at its first lowering):
# ResNet-18 seeds 4-5, AMP bs 192 against the default; EfficientNet-B0 seed 0, AMP bs 512 against the default.
O=$OUT; mkdir -p $O/r18 $O/eff; date -u
OUT=$O/r18 MODEL=resnet18 SEEDS="4 5" LIMIT=80 timeout 230 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" > $O/r18/jax.log 2>&1
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0" WARMUP=0 LIMIT=165 timeout 340 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB" > $O/eff/jax.log 2>&1
for f in $O/r18/jax.log $O/eff/jax.log; do grep -v "^W1\|Warning" $f | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; done
for d in r18 eff; do (cd $O/$d && tar czf ../$d.tgz --remove-files -- * 2>/dev/null); rmdir $O/$d; done; ls $O
