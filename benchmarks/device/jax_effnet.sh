# JAX EfficientNet-B0, seed SEED (default 0), cold runs on empty caches (one compiled step shape each, or the climb's):
# triaccel with --pad-floor largest --compile-ahead after, then AMP at static batches given as arguments
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_effnet.sh 384
# each run limited to LIMIT seconds (default 280); one summary line per run, summaries to $OUT; SUFFIX
# (e.g. -warm) is appended to the run names (after -sSEED): a second call on the same machine then reruns on the caches;
# TRI=0 runs the static batches only; EXTRA (e.g. "--gc-freeze off") is added to every run's arguments
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs; LIMIT=${LIMIT:-280}
one() {  # name cache demo-args...
  name=$1; cache=$2; shift 2
  TRIACCEL_CACHE=$cache timeout $LIMIT python3 -m examples.cifar.train --backend jax --model efficientnet_b0 --epochs 10 --data $D --seed ${SEED:-0} --no-progress --compile-cache $cache/jax --out /tmp/runs/$name "$@" $EXTRA > $OUT/$name.log 2>&1
  echo "$name rc $?"; cp /tmp/runs/$name/summary.json $OUT/$name.json 2>/dev/null
  python3 - "/tmp/runs/$name/summary.json" "$name" <<'PY'
import json, sys, os
if not os.path.exists(sys.argv[1]): sys.exit(print(sys.argv[2], "no summary"))
s = json.load(open(sys.argv[1])); e = s["epoch_seconds"]
print(f"{sys.argv[2]:<18} acc {s['final_acc']} train_s {sum(e):.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 1) for x in e]} batch {s.get('final_batch')} "
      f"peak {s.get('peak_alloc_bytes', 0) / 2**30:.2f} GiB")
PY
}
[ "${TRI:-1}" = 1 ] && one tri-pad-after-s${SEED:-0}${SUFFIX:-} /tmp/e_tri --method triaccel --budget 4GiB --pad-floor largest --compile-ahead after
for b in "$@"; do one amp-$b-s${SEED:-0}${SUFFIX:-} /tmp/e_amp$b --method amp --batch $b; done
