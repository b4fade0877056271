# Cold JAX demo runs (10 epochs) of named variants, per seed, one after another on one GPU:
#   MODEL=efficientnet_b0 SEEDS="0 1" bash benchmarks/device/jax_variants.sh \
#     "amp512=--method amp --batch 512" "mask=--method triaccel --budget 4GiB --bn-mask on"
# Each argument is NAME=DEMO-ARGS. MODEL (default resnet18), SEEDS (default 0), EPOCHS (default 10), LIMIT
# (seconds per run, default 200). Every run on its own empty compilation cache and an empty jax-triton
# kernel cache (each triaccel run compiles its kernels, as a first run on a machine does). WARM=1: each variant keeps its caches from seed to seed (the first seed runs cold, the
# others warm: for accuracy over seeds at a fraction of the device time; compare walls within a seed only). Logs, step records and summaries go to $OUT/s<seed>/, packed into $OUT/runs.tgz when there
# are more than 8 files (the device returns at most 8 per call); one summary line per run.
# (device tool, nvidia-h200, carry [".device"])
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
one() { seed=$1; name=$2; shift 2; dir=$OUT/s$seed
  [ "${WARM:-0}" = 1 ] || rm -rf "$TRIACCEL_CACHE/jax-triton"   # every cold run compiles its Triton kernels
  timeout ${LIMIT:-200} python3 -m examples.cifar.train --backend jax --model ${MODEL:-resnet18} --data $D --seed $seed \
  --epochs ${EPOCHS:-10} --no-progress --compile-cache /tmp/cc/$cc$name --out /tmp/runs/s$seed-$name $@ > $dir/$name.log 2>&1
  echo "s$seed $name rc $?"
  cp /tmp/runs/s$seed-$name/log.jsonl $dir/$name.jsonl   # step records: host time per step (step_gaps.py)
  cp /tmp/runs/s$seed-$name/summary.json $dir/$name.json || return; python3 -c "
import json; s=json.load(open('$dir/$name.json'))
print(f\"s$seed {'$name':<12} acc {s['final_acc']:.4f} train_s {s['train_seconds']:.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in s['epoch_seconds']]} batch {s['final_batch']} peak_GiB {s['peak_alloc_bytes'] / 2**30:.2f}\"); print('  compile on the critical path (s)', s['compile_log']['total']['critical']['seconds'])"; }
seeds=${SEEDS:-${SEED:-0}}
rm -rf "$TRIACCEL_CACHE" /tmp/cc
for seed in $seeds; do
  if [ "${WARM:-0}" = 1 ]; then cc=; else cc=s$seed-; rm -rf "$TRIACCEL_CACHE" /tmp/cc; fi
  rm -rf /tmp/runs; mkdir -p /tmp/runs $OUT/s$seed
  for v in "$@"; do one $seed "${v%%=*}" ${v#*=}; done
done
if [ "$(find $OUT -type f | wc -l)" -gt 8 ]; then (cd $OUT && tar czf runs.tgz s* && rm -rf s*/); fi
