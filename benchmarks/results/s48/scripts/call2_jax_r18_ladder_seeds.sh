# (next session, ~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 500)
# JAX ResNet-18 seeds 1-2, cold: AMP bs 192, the default (doubling ladder, halves), and torch's new default
# settings (no 384 rung, noise_split=double). s47 call 4 (seed 0): 1.11x against 1.21x; one seed is no verdict
# (torch's seed 0 also climbed later with them).
O=$OUT; mkdir -p $O/jax; date -u
L='--set batch_buckets=[12,24,48,96,192,512] --set noise_split=double'
OUT=$O/jax MODEL=resnet18 SEEDS="1 2" LIMIT=95 timeout 470 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" "tri3d=--method triaccel --budget 4GiB $L" \
  > $O/jax/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax/jax.log | grep "acc\|wall_s\|critical\|rror" | sed "s/setup_phases.*//" | head -30
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
