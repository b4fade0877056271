# Issue 15 item 2 (JAX) and #14's per-epoch cost at equal batch: the JAX demo's AMP and triaccel-fixed epochs
# against a plain JAX loop (one jitted program per step), each variant in its own process, same batch.
#   bash benchmarks/device/jax_harness.sh efficientnet_b0 512      (device tool, nvidia-h200, carry [".device"])
#   bash benchmarks/device/jax_harness.sh resnet18 96 512
# first argument the model, then the batch sizes; EPOCHS (default 4); the table last, runs packed in $OUT/runs.tgz
source benchmarks/device/prep.sh; cd /tmp/pkg
m=$1; shift
timeout 560 python3 benchmarks/harness.py --backend jax --model "$m" --data /tmp/data/cifar10-jpeg --epochs ${EPOCHS:-4} \
  --batch-sizes "$@" --variants plain amp triaccel-fixed --out /tmp/harness > $OUT/harness-$m.log 2>&1
echo "rc $?"; cp /tmp/harness/harness.json $OUT/harness-$m.json 2>/dev/null
tar -czf $OUT/runs.tgz -C /tmp/harness runs 2>/dev/null
tail -8 $OUT/harness-$m.log
