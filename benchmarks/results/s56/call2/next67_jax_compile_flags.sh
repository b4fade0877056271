# (next session: ~5 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it and next/unguarded.patch to
# .device/; timeout_s 420)
# #14/#15 JAX: two untried ways to a shorter step compilation, each on both sides.
# 1. XLA compiles the final module's LLVM IR on one thread unless xla_gpu_enable_llvm_module_compilation_parallelism
#    is on (default false in XLA's debug_options_flags.cc). s50 call 1's timers: `RunBackend for jit_train_body` 1.08 s
#    (AMP bs 192) against 3.23 s (triaccel; IR emission 0.63 / 1.97 s of it), so at most ~1 s of triaccel's +4-6 s.
#    One cold epoch on 2,048 images per run (own empty caches): AMP bs 192 and triaccel, without and with the flag
#    (--xla-option, every program of the run).
# 2. The update's finite guard: on the dev box's CPU the wrapped EfficientNet-B0 update compiles 7.38 s with it and
#    6.25 s with `apply` no longer depending on the global finite flag (next/unguarded.patch, a probe, not a proposal:
#    the guard is what skips a non-finite step); plain SGD 2.11 s. The update alone on the GPU, plain / wrapped, with
#    and without the patch (jax_update_compile.py: compile s, fusions, ms per call).
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
F=xla_gpu_enable_llvm_module_compilation_parallelism=true
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 150 python3 -m examples.cifar.train \
  --backend jax --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 \
  --test-subset 500 --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/$name.log) wall $(python3 -c "import json;print(json.load(open('/tmp/runs/$name/summary.json'))['wall_seconds'])" 2>/dev/null)" >> $O/table.txt; }
python3 -m examples.cifar.train --backend jax --epochs 1 --data /tmp/data/cifar10-jpeg --train-subset 256 --test-subset 100 \
  --no-progress --out /tmp/runs/warm --method amp > $O/warmup.log 2>&1   # the machine's one-time costs, outside the table
one amp --method amp --batch 192
one amp_par --method amp --batch 192 --xla-option $F
one tri --method triaccel --budget 4GiB
one tri_par --method triaccel --budget 4GiB --xla-option $F
one amp_b --method amp --batch 192
one tri_par_b --method triaccel --budget 4GiB --xla-option $F
upd() { timeout 100 python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --variants plain auto \
  --out $O/upd-$1 "${@:2}" 2>&1 | tail -3 > $O/update-$1.txt; cat $O/update-$1.txt; }
upd guarded
upd guarded_par --xla-option $F
cd $R && patch -p1 < .device/unguarded.patch && source benchmarks/device/prep.sh && cd /tmp/pkg
upd unguarded
cat $O/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
