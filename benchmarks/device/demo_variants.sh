# Cold demo runs (10 epochs) of named variants, per seed, one after another on one GPU, in either backend:
#   BACKEND=jax MODEL=efficientnet_b0 SEEDS="0 1" bash benchmarks/device/demo_variants.sh \
#     "amp512=--method amp --batch 512" "tri=--method triaccel --budget 4GiB"
# (jax_variants.sh and torch_variants.sh call this with BACKEND set.) Each argument is NAME=DEMO-ARGS.
# BACKEND (jax | torch, default jax), MODEL (default resnet18), SEEDS (default 0), EPOCHS (default 10), LIMIT
# (seconds per run, default 200). Every run starts cold, as a first run on a machine does: JAX on its own
# empty compilation cache and an empty jax-triton kernel cache; torch with inductor's caches
# (/tmp/torchinductor_$USER) and Triton's kernel cache emptied; what only a machine's first process pays goes to a warm-up process
# run before them (WARMUP=0: none; WARMUP_MODEL, default resnet18, is its model), and the decoded images are cached for every run. WARM=1: each variant keeps its caches from seed to seed (the first
# seed runs cold, the others warm: for accuracy over seeds at a fraction of the device time; compare walls
# within a seed only). Logs and summaries go to $OUT/s<seed>/ (step records into $OUT/step-records.tgz), packed into $OUT/runs.tgz past 8
# files (the device returns at most 8 per call); one summary line per run, with the process's wall seconds.
# (device tool, nvidia-h200, carry [".device"])
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg; B=${BACKEND:-jax}
one() { seed=$1; name=$2; shift 2; dir=$OUT/s$seed; extra=()
  if [ "$B" = jax ]; then
    [ "${WARM:-0}" = 1 ] || rm -rf "$TRIACCEL_CACHE/jax-triton"   # every cold run compiles its Triton kernels
    extra=(--compile-cache /tmp/cc/$cc$name)
  else
    # cold: inductor's caches and Triton's kernel cache (triaccel's statistics kernel compiles again)
    [ "${WARM:-0}" = 1 ] || rm -rf /tmp/torchinductor_* "${TRITON_CACHE_DIR:-$HOME/.triton/cache}" 2>/dev/null
  fi
  t0=$EPOCHREALTIME
  timeout ${LIMIT:-200} python3 -m examples.cifar.train --backend $B --model ${MODEL:-resnet18} --data $D --seed $seed \
    --epochs ${EPOCHS:-10} --no-progress "${extra[@]}" --out /tmp/runs/s$seed-$name $@ > $dir/$name.log 2>&1
  rc=$?; wall=$(python3 -c "import time; print(round(time.time() - $t0, 1))"); echo "s$seed $name rc $rc"
  cp /tmp/runs/s$seed-$name/log.jsonl $dir/$name.jsonl   # step records: host time per step (step_gaps.py)
  cp /tmp/runs/s$seed-$name/summary.json $dir/$name.json || return; python3 -c "
import json; s=json.load(open('$dir/$name.json')); e=s['epoch_seconds']
print(f\"s$seed {'$name':<12} acc {s['final_acc']:.4f} train_s {sum(e):.1f} process_s $wall epochs {[round(x, 2) for x in e]} steps {s['steps']} batch {s['final_batch']} peak_GiB {(s['peak_alloc_bytes'] or 0) / 2**30:.2f}\")
if 'setup_seconds' in s: print(f\"  wall_s {s['wall_seconds']:.1f} setup_s {s['setup_seconds']:.1f} eval_s {sum(s['eval_seconds']):.1f} data_s {s['data_load_seconds']:.1f} setup_phases {s.get('setup_phases')}\")
if 'compile_log' in s: print(f\"  compile on the critical path (s) {s['compile_log']['total']['critical']['seconds']}\")
if s.get('compiled_graphs') is not None: print('  compiled graphs', s['compiled_graphs'])"; }
seeds=${SEEDS:-${SEED:-0}}
# Cold = empty compilation caches; the decoded images stay cached for every run (decoding is not what is
# compared: it cost the first run of each seed 1.1 s more than the second, 2026-11-28).
clear_caches() { find "$TRIACCEL_CACHE" -mindepth 1 -maxdepth 1 ! -name '*.npz' -exec rm -rf {} + 2>/dev/null; rm -rf /tmp/cc; }
clear_caches
# A short process first (WARMUP=0: none) pays what only a machine's first process pays, whichever run that
# is: the packages' bytecode, matplotlib's font cache (5.5 s and 10.5 s under cProfile, 2026-11-28), the
# driver's set-up; it also decodes the images into the cache. None of that depends on the model, so it runs
# ResNet-18 (WARMUP_MODEL): an EfficientNet-B0 warm-up spent ~2 min compiling what clear_caches then drops
# (s52 call 2).
if [ "${WARMUP:-1}" = 1 ]; then
  timeout 300 python3 -m examples.cifar.train --backend $B --model ${WARMUP_MODEL:-resnet18} --data $D --epochs 1 \
    --train-subset 512 --test-subset 500 --no-progress --method amp --out /tmp/runs/warmup > $OUT/warmup.log 2>&1
  echo "warm-up process rc $?"; clear_caches
fi
for seed in $seeds; do
  if [ "${WARM:-0}" = 1 ]; then cc=; else cc=s$seed-; clear_caches; fi
  rm -rf /tmp/runs; mkdir -p /tmp/runs $OUT/s$seed
  for v in "$@"; do one $seed "${v%%=*}" ${v#*=}; done
done
# the step records compressed apart (~5x smaller): committed as they come back, the repository stays under the
# 64 MiB the device tool carries (2026-11-28: 45 MB tracked with them unpacked)
(cd $OUT && find s[0-9]* -name "*.jsonl" | sort > /tmp/jsonl.txt && [ -s /tmp/jsonl.txt ] \
  && tar czf step-records.tgz -T /tmp/jsonl.txt && xargs rm < /tmp/jsonl.txt)
if [ "$(find $OUT -type f | wc -l)" -gt 8 ]; then (cd $OUT && tar czf runs.tgz s[0-9]* && rm -rf s[0-9]*/); fi
