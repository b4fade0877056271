# run NAME CACHE DEMO-ARGS...: one seed-0 JAX demo run on the cache folder CACHE (empty: a cold run), its
# summary to $OUT/NAME.json and one printed line (accuracy, training s, epochs, peak, compile per epoch)
# (sourced by jax_cold.sh, jax_pad.sh, jax_after.sh; run from /tmp/pkg after benchmarks/device/prep.sh)
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs
run() {  # name cache extra...
  name=$1; cache=$2; shift 2
  TRIACCEL_CACHE=$cache timeout 200 python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 10 --data $D --seed 0 --no-progress --compile-cache $cache/jax --out /tmp/runs/$name "$@" > /tmp/runs/$name.log 2>&1; cp /tmp/runs/$name/summary.json $OUT/$name.json; tail -4 /tmp/runs/$name.log >> $OUT/all.log; grep -i "warn\|error" /tmp/runs/$name.log | head -3
  python3 - "/tmp/runs/$name" "$name" <<'PY'
import json, sys, glob
f = glob.glob(sys.argv[1] + "/**/summary.json", recursive=True) + glob.glob(sys.argv[1] + "/summary.json")
if not f: print(sys.argv[2], "no summary"); sys.exit()
s = json.load(open(f[0]))
e = s.get("epoch_seconds", [])
cl = [(round(x["critical"]["seconds"], 1), round(x["background"]["seconds"], 1)) for x in s.get("compile_log", {}).get("epochs", [])[:3]]
print(f"{sys.argv[2]:<14} acc {s.get('final_acc')} train_s {sum(e):.1f} epochs {[round(x,1) for x in e]} "
      f"peak {s.get('peak_alloc_bytes', 0) / 2**30:.2f} GiB compile {cl} batch {s.get('final_batch')}")
PY
}
