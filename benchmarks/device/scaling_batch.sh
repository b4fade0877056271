# Issue 16's next call (nvidia-h200-x2, ~8 min): does data parallelism reach 0.9 per GPU once the
# per-GPU step is GPU-bound? At 384 per GPU the 2-GPU step was ~2 ms longer than the 1-GPU step with
# no NCCL kernel over 0.3 ms (host work the second rank adds; docs/results.md, 2026-11-23 08:25Z):
# torch triaccel 0.75, AMP through the same step 0.83, JAX 0.65. Here the same runs at PER per GPU
# (default 1024; the step's GPU time grows with the batch, the host's does not). Throughput only: every
# run's lr is fixed at 0.8 (the demo's rule would give 0.1 x 2048 / 96 = 2.1 on two GPUs), EPOCHS (default 6) epochs.
# GPUS (default 1,2) lists the GPU counts, RUNS the backend:method pairs (default all three).
#   PER=1024 bash benchmarks/device/scaling_batch.sh        (device tool, kind nvidia-h200-x2, carry [".device"])
#   GPUS=1,2,4 RUNS="torch:triaccel jax:triaccel" EPOCHS=4 bash benchmarks/device/scaling_batch.sh   (nvidia-h200-x4)
source benchmarks/device/prep.sh; cd /tmp/pkg
PER=${PER:-1024}; EPOCHS=${EPOCHS:-6}; GPUS=${GPUS:-1,2}
for run in ${RUNS:-torch:triaccel torch:amp jax:triaccel}; do
  set -- ${run/:/ }
  timeout 420 python3 benchmarks/scaling.py --backend $1 --method $2 --gpus $GPUS --epochs $EPOCHS --levers precision \
    --batch $PER --batch-max $PER --data /tmp/data/cifar10-jpeg --timeout 150 \
    --out $OUT/scaling-$1-$2-$PER.json -- --lr 0.8 > $OUT/scaling-$1-$2-$PER.log 2>&1
  echo "== $1 $2, $PER per GPU"; tail -4 $OUT/scaling-$1-$2-$PER.log
done
