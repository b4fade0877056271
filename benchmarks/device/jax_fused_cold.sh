# Cold JAX ResNet-18 runs (10 epochs): per seed, AMP bs 192 first, then triaccel from its defaults with each
# setting of one option: OPT (default fused-step) over VALUES (default "on off"). Every run on its own empty
# compilation cache; before each seed the jax-triton kernel cache is emptied too (so each seed's first
# triaccel run compiles its kernels, as a first run on a machine does).
#   bash benchmarks/device/jax_fused_cold.sh                                    one program per step against two
#   OPT=pad-floor VALUES="auto off" bash benchmarks/device/jax_fused_cold.sh    small batches padded or not
#   SEEDS="0 1 2" VALUES=auto bash benchmarks/device/jax_fused_cold.sh           three seeds, the defaults
# SEEDS (default: SEED, default 0). Logs and summaries go to $OUT/s<seed>/, packed into $OUT/runs.tgz when
# there is more than one seed (the device returns at most 8 files per call); one summary line per run.
# (device tool, nvidia-h200, carry [".device"])
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
one() { seed=$1; name=$2; shift 2; dir=$OUT/s$seed
  timeout 200 python3 -m examples.cifar.train --backend jax --model resnet18 --data $D --seed $seed \
  --epochs 10 --no-progress --compile-cache /tmp/cc/s$seed-$name --out /tmp/runs/s$seed-$name "$@" > $dir/$name.log 2>&1
  echo "s$seed $name rc $?"
  cp /tmp/runs/s$seed-$name/summary.json $dir/$name.json || return; python3 -c "
import json; s=json.load(open('$dir/$name.json'))
print(f\"s$seed {'$name':<12} acc {s['final_acc']:.4f} train_s {s['train_seconds']:.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in s['epoch_seconds']]} batch {s['final_batch']} peak_GiB {s['peak_alloc_bytes'] / 2**30:.2f}\"); print('  critical', s['compile_log']['total'])"; }
seeds=${SEEDS:-${SEED:-0}}
for seed in $seeds; do
  rm -rf "$TRIACCEL_CACHE" /tmp/cc /tmp/runs; mkdir -p /tmp/runs $OUT/s$seed
  one $seed amp192 --method amp --batch 192
  for f in ${VALUES:-on off}; do one $seed tri-$f --method triaccel --budget 4GiB --${OPT:-fused-step} $f; done
done
if [ "$(echo $seeds | wc -w)" -gt 1 ]; then (cd $OUT && tar czf runs.tgz s* && rm -rf s*/); fi
