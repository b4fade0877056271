# torch demo runs (10 epochs) of named variants, per seed, one after another on one GPU:
#   MODEL=efficientnet_b0 SEEDS="0 1" bash benchmarks/device/torch_variants.sh \
#     "amp512=--method amp --batch 512" "amp512cg=--method amp --batch 512 --compile cudagraphs" \
#     "tri=--method triaccel --budget 4GiB" "tricg=--method triaccel --budget 4GiB --compile cudagraphs"
# Each argument is NAME=DEMO-ARGS. MODEL (default resnet18), SEEDS (default 0), EPOCHS (default 10), LIMIT
# (seconds per run, default 200). torch.compile's caches (inductor's, under /tmp/torchinductor_$USER) are
# emptied before every run, so a compiled run pays its compilation as a first run on a machine does.
# Logs, step records and summaries go to $OUT/s<seed>/ (packed into $OUT/runs.tgz past 8 files: the
# device returns at most 8 files per call); one summary line per run, with the process's wall seconds.
# (device tool, nvidia-h200, carry [".device"])
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
one() { seed=$1; name=$2; shift 2; dir=$OUT/s$seed
  rm -rf /tmp/torchinductor_* 2>/dev/null
  t0=$EPOCHREALTIME
  timeout ${LIMIT:-200} python3 -m examples.cifar.train --backend torch --model ${MODEL:-resnet18} --data $D --seed $seed \
    --epochs ${EPOCHS:-10} --no-progress --out /tmp/runs/s$seed-$name $@ > $dir/$name.log 2>&1
  rc=$?; wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))"); echo "s$seed $name rc $rc"
  cp /tmp/runs/s$seed-$name/log.jsonl $dir/$name.jsonl   # step records: host time per step (step_gaps.py)
  cp /tmp/runs/s$seed-$name/summary.json $dir/$name.json || return; python3 -c "
import json; s=json.load(open('$dir/$name.json')); e=s['epoch_seconds']
print(f\"s$seed {'$name':<10} acc {s['final_acc']:.4f} train_s {sum(e):.1f} process_s $wall epochs {[round(x, 2) for x in e]} steps {s['steps']} batch {s['final_batch']} graphs {s.get('compiled_graphs')}\")"; }
seeds=${SEEDS:-${SEED:-0}}
for seed in $seeds; do
  rm -rf /tmp/runs; mkdir -p /tmp/runs $OUT/s$seed
  for v in "$@"; do one $seed "${v%%=*}" ${v#*=}; done
done
if [ "$(find $OUT -type f | wc -l)" -gt 8 ]; then (cd $OUT && tar czf runs.tgz s* && rm -rf s*/); fi
