# Cold JAX ResNet-18 runs (10 epochs): per seed, AMP bs 192 first, then triaccel from its defaults with each
# setting of one option: OPT (default fused-step) over VALUES (default "on off"); see jax_variants.sh (caches,
# outputs, SEEDS).
#   bash benchmarks/device/jax_fused_cold.sh                                    one program per step against two
#   OPT=pad-floor VALUES="auto off" bash benchmarks/device/jax_fused_cold.sh    small batches padded or not
#   SEEDS="0 1 2" VALUES=auto bash benchmarks/device/jax_fused_cold.sh           three seeds, the defaults
# (device tool, nvidia-h200, carry [".device"])
set -- "amp192=--method amp --batch 192"
for f in ${VALUES:-on off}; do set -- "$@" "tri-$f=--method triaccel --budget 4GiB --${OPT:-fused-step} $f"; done
MODEL=resnet18 bash benchmarks/device/jax_variants.sh "$@"
