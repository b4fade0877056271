# cold JAX runs, seed 0, each on empty caches: XLA autotuning levels (XLA_FLAGS) for AMP bs 192 and triaccel
# usage (device tool): R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg; bash $R/benchmarks/device/jax_xla.sh  (each run limited to 200 s)
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs
run() {  # name flags extra...
  name=$1; flags=$2; shift 2
  XLA_FLAGS="$flags" TRIACCEL_CACHE=/tmp/c_$name timeout 200 python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 10 --data $D --seed 0 --no-progress --compile-cache /tmp/c_$name/jax --out /tmp/runs/$name "$@" > /tmp/runs/$name.log 2>&1; cp /tmp/runs/$name/summary.json $OUT/$name.json
  python3 - "/tmp/runs/$name" "$name" "$flags" <<'PY'
import json, sys
s = json.load(open(sys.argv[1] + "/summary.json"))
e = s.get("epoch_seconds", [])
cl = s.get("compile_log", {}).get("epochs", [])
cc = [(round(x["critical"]["seconds"], 1), round(x["background"]["seconds"], 1)) for x in cl[:3]]
print(f"{sys.argv[2]:<16} acc {s.get('final_acc')} train_s {sum(e):.1f} epochs {[round(x,1) for x in e]} compile(crit,bg) {cc} [{sys.argv[3]}]")
PY
}
run amp-def "" --method amp --batch 192
run tri-def "" --method triaccel --budget 4GiB
run tri-at0 "--xla_gpu_autotune_level=0" --method triaccel --budget 4GiB
run amp-at0 "--xla_gpu_autotune_level=0" --method amp --batch 192
run tri-at1 "--xla_gpu_autotune_level=1" --method triaccel --budget 4GiB
