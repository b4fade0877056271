# Issue 16: the same global batch on 1 and NGPU (default 2) GPUs, seeds given as arguments: triaccel with
# the precision lever (batch fixed at GLOBAL), 10 epochs, the demo's LR rule and warm-up. BACKEND=torch
# (default: DDP through torchrun, BatchNorm per rank, evaluated with the ranks' averaged statistics) or
# jax (one process over NGPU devices, --batch-stats STATS, default per-device).
#   GLOBAL=1024 bash benchmarks/device/dp_accuracy.sh 0 1 2     (device tool, kind nvidia-h200-x2, carry [".device"])
#   NGPU=4 GLOBAL=512 bash benchmarks/device/dp_accuracy.sh 0 1 2   (nvidia-h200-x4)
#   BACKEND=jax NGPU=4 GLOBAL=512 bash benchmarks/device/dp_accuracy.sh 0 1 2
# PARTS=K (torch) adds a third run per seed: one GPU with --bn-parts K (BatchNorm statistics over K slices of
# each batch, as K ranks compute them), to tell the ranks' BatchNorm apart from the rest of data parallelism:
#   NGPU=4 GLOBAL=512 PARTS=4 bash benchmarks/device/dp_accuracy.sh 0 1 2
# AUG=sample (torch): every run with --augment-rng sample (each sample's crops from (seed, epoch, index), alike on
# any number of ranks), so that one GPU with --bn-parts N computes what N ranks do (a CPU test checks it):
#   NGPU=4 GLOBAL=512 PARTS=4 AUG=sample bash benchmarks/device/dp_accuracy.sh 0 1 2
source benchmarks/device/prep.sh; cd /tmp/pkg
G=${GLOBAL:-1024}; N=${NGPU:-2}; B=${BACKEND:-torch}; D=/tmp/data/cifar10-jpeg
# logs gather in L and are packed into $OUT/logs.tgz after each seed (the device tool returns few files)
L=/tmp/dplogs; mkdir -p $L
common="-m examples.cifar.train --backend $B --method triaccel --levers precision --batch $G --batch-max $G --epochs 10 --data $D --no-progress${AUG:+ --augment-rng $AUG}"
for s in "$@"; do
  if [ "$B" = jax ]; then
    timeout 150 python3 $common --devices 1 --seed $s --out /tmp/runs/dp1-s$s > $L/dp1-s$s.log 2>&1
    timeout 150 python3 $common --devices $N --batch-stats ${STATS:-per-device} --seed $s --out /tmp/runs/dp$N-s$s \
      > $L/dp$N-s$s.log 2>&1
  else
    timeout 150 python3 $common --seed $s --out /tmp/runs/dp1-s$s > $L/dp1-s$s.log 2>&1
    timeout 150 torchrun --standalone --nproc-per-node $N $common --seed $s --out /tmp/runs/dp$N-s$s > $L/dp$N-s$s.log 2>&1
    [ -n "$PARTS" ] && timeout 150 python3 $common --bn-parts $PARTS --seed $s --out /tmp/runs/dp1p$PARTS-s$s \
      > $L/dp1p$PARTS-s$s.log 2>&1
  fi
  for n in 1 $N ${PARTS:+1p$PARTS}; do
    python3 - /tmp/runs/dp$n-s$s "$n GPU seed $s" <<'PY'
import glob, json, sys
f = sorted(glob.glob(sys.argv[1] + "/**/summary.json", recursive=True))
if not f: sys.exit(print(sys.argv[2], "no summary"))
s = json.load(open(f[0])); e = s["epoch_seconds"]
print(f"{sys.argv[2]:<14} acc {s['final_acc']:.4f} train_s {sum(e):.1f} world {s.get('world_size', s.get('devices', 1))} "
      f"agree {s.get('ranks_agree')} rank0-stats {s.get('final_acc_rank0_buffers')} batch {s.get('final_batch')} accs {[round(a, 3) for a in s.get('accs', [])]}")
PY
  done
  for d in /tmp/runs/dp*-s$s; do f=$(find $d -name summary.json | head -1); [ -n "$f" ] && cp $f $L/$(basename $d).json; done
  tar -czf $OUT/logs.tgz -C $L .
done
