# Cold JAX demo runs of named variants per seed: benchmarks/device/demo_variants.sh with BACKEND=jax, e.g.
#   MODEL=efficientnet_b0 SEEDS="0 1" bash benchmarks/device/jax_variants.sh \
#     "amp512=--method amp --batch 512" "mask=--method triaccel --budget 4GiB --bn-mask on"
BACKEND=jax exec bash "$(dirname "$0")/demo_variants.sh" "$@"
