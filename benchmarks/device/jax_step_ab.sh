# JAX demo: AMP and triaccel at one fixed batch, interleaved on one machine, to separate the wrapper's
# per-step cost from the machine's host-speed drift between calls.
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; MODEL=efficientnet_b0 bash $R/benchmarks/device/jax_step_ab.sh
#   MODEL (resnet18), BATCH (384), EPOCHS (3), ROUNDS (2), TRACE (e.g. 200:230: traced steps of the last round),
#   TRI_ARGS (extra triaccel args), KERNELS (e.g. "auto reference": one triaccel run per
#   TriAccelConfig.kernels value, named tri-<kernels>; default: one run, named tri, with the config's default).
#   triaccel = --levers precision --batch BATCH --batch-max BATCH (the batch
#   lever off; evidence precision law, its noise measurements every t_noise steps, the wrapped update).
#   Round 1 compiles (own cache per method), later rounds read the caches. Per run one summary line; per
#   traced run the trace summary with counts; step gaps of every run.
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs; M=${MODEL:-resnet18}; B=${BATCH:-384}; N=${ROUNDS:-2}
one() {  # name demo-args...
  name=$1; shift
  timeout ${LIMIT:-280} python3 -m examples.cifar.train --backend jax --model $M --data $D --seed ${SEED:-0} --no-progress \
    --epochs ${EPOCHS:-3} --batch $B --compile-cache /tmp/cc/$M-${name%-r*} --out /tmp/runs/$name "$@" > $OUT/$name.log 2>&1
  echo "$name rc $?"; cp /tmp/runs/$name/log.jsonl $OUT/$name.jsonl; cp /tmp/runs/$name/summary.json $OUT/$name.json || return
  python3 -c "
import json; s=json.load(open('/tmp/runs/$name/summary.json')); e=s['epoch_seconds']
print(f\"{'$name':<14} acc {s['final_acc']:.4f} train_s {sum(e):.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in e]} steps {s['steps']}\")"
  [ -d /tmp/runs/$name/trace ] && python3 benchmarks/trace_summary.py /tmp/runs/$name --counts --json $OUT/$name-trace.json
}
for r in $(seq 1 $N); do
  tr=(); [ -n "$TRACE" ] && [ $r = $N ] && tr=(--trace-steps $TRACE)
  one amp-r$r --method amp "${tr[@]}"
  if [ -z "$KERNELS" ]; then one tri-r$r --method triaccel --levers precision --batch-max $B $TRI_ARGS "${tr[@]}"; fi
  for k in $KERNELS; do
    one tri-$k-r$r --method triaccel --levers precision --batch-max $B --set kernels=$k $TRI_ARGS "${tr[@]}"
  done
done
python3 benchmarks/device/step_gaps.py $OUT/*.jsonl --epochs ${EPOCHS:-3}
# the device returns at most 8 files per call
if [ "$(ls $OUT | wc -l)" -gt 8 ]; then (cd $OUT && tar czf runs.tgz --remove-files -- *.log *.json *.jsonl); fi
