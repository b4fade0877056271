# Cold JAX ResNet-18 runs (own compilation cache each; 10 epochs, seed SEED), AMP bs 192 first, then triaccel
# from its defaults with each setting of one option: OPT (default fused-step) over VALUES (default "on off"):
#   bash benchmarks/device/jax_fused_cold.sh                          one program per step against two
#   OPT=pad-floor VALUES="auto off" bash benchmarks/device/jax_fused_cold.sh   small batches padded or not
# (device tool, nvidia-h200, carry [".device"])
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg; mkdir -p /tmp/runs
one() { name=$1; shift; timeout 200 python3 -m examples.cifar.train --backend jax --model resnet18 --data $D --seed ${SEED:-0} \
  --epochs 10 --no-progress --compile-cache /tmp/cc/$name --out /tmp/runs/$name "$@" > $OUT/$name.log 2>&1; echo "$name rc $?"
  cp /tmp/runs/$name/summary.json $OUT/$name.json || return; python3 -c "
import json; s=json.load(open('/tmp/runs/$name/summary.json'))
print(f\"{'$name':<12} acc {s['final_acc']:.4f} train_s {s['train_seconds']:.1f} wall_s {s['wall_seconds']:.1f} epochs {[round(x, 2) for x in s['epoch_seconds']]} batch {s['final_batch']} peak_GiB {s['peak_alloc_bytes'] / 2**30:.2f}\"); print('  critical', s['compile_log']['total'])"; }
one amp192 --method amp --batch 192
for f in ${VALUES:-on off}; do one tri-$f --method triaccel --budget 4GiB --${OPT:-fused-step} $f; done
