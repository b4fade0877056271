# (s47 call 4, nvidia-h200, carry [".device"]; timeout_s 330)
# JAX ResNet-18 seed 0, cold: AMP bs 192, the default, and the ladder without 384 with noise_split=double
# (torch calls 2-3: EfficientNet-B0 1.06-1.14x against the default's 1.13-1.23x, ResNet-18 0.96-1.03x).
O=$OUT; mkdir -p $O/jax; date -u
L='--set batch_buckets=[12,24,48,96,192,512] --set noise_split=double'
OUT=$O/jax MODEL=resnet18 SEEDS=0 LIMIT=95 timeout 310 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" "tri3d=--method triaccel --budget 4GiB $L" \
  > $O/jax/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax/jax.log | grep "acc\|wall_s\|critical\|rror" | sed "s/setup_phases.*//" | head -20
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
