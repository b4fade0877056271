# s53 call 2 (nvidia-h100-x1, warm after call 1, timeout_s 595): s52's next56 (JAX ResNet-18 seeds 4-6, AMP bs 192
# against the default) with its outer timeout 330 s, then next60 (#17 ResNet-152 bf16 under 8 GiB) with 220 s.
cp benchmarks/results/s53/scripts/next56_jax_r18_seeds.sh benchmarks/results/s53/scripts/next60_offload_refined.sh /tmp/
sed -i 's/timeout 380/timeout 330/' /tmp/next56_jax_r18_seeds.sh; sed -i 's/timeout 360/timeout 220/' /tmp/next60_offload_refined.sh
B=$OUT; mkdir -p $B/r18 $B/off; OUT=$B/r18 bash /tmp/next56_jax_r18_seeds.sh; OUT=$B/off bash /tmp/next60_offload_refined.sh
