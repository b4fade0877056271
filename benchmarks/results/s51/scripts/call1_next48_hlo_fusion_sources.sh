# (next session, ~5 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 420)
# #14/#15 JAX: s50 call 1 found triaccel's ResNet-18 step with 281 kernels against AMP's 187 and 114 transpose-fusion
# candidates against 74. Which Python lines make them: the optimized GPU HLO of both steps (cold, one epoch of 2,048
# images), their fusions by name side by side, and the sources of the transpose and reduce fusions
# (benchmarks/hlo_fusions.py). A guess to check: the statistics' reshape(-1) of small conv kernels whose GPU layout
# is not row-major (kernels/grad_moments.py, moments_reference_jnp_tree's stacking) is a transpose per array;
# `stack_vectors_only.patch` (copy it to .device/ too) stacks only 1-D arrays: its step dumped third, compile times beside.
# Then the lever for epoch 1's bs-96 steps (s50 README, "Next"): benchmarks/device/jax_fused_steps_probe.py, the
# ResNet-18 bf16 step at bs 96 one per call, at the bs-512 program (today's, under the pad floor), and 10 / 25 per
# lax.scan call: ms per bs-96 step and compile seconds.
O=$OUT; mkdir -p $O/hlo $O/fused; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
dump() { name=$1; shift; mkdir -p /tmp/hc_$name; TRIACCEL_CACHE=/tmp/hc_$name \
  XLA_FLAGS="--xla_dump_to=/tmp/hd_$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_body.*" timeout 90 \
  python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 1 --data $D --seed 0 --no-progress \
  --train-subset 2048 --test-subset 1000 --compile-cache /tmp/hc_$name/jax --out /tmp/runs/hd_$name "$@" > $O/hlo/$name.log 2>&1
  echo "$name rc $?"; cp $(ls /tmp/hd_$name/*train_body*after_optimizations.txt | grep -v buffer | head -1) $O/hlo/$name-train_body.txt; }
dump amp --method amp --batch 192
dump tri --method triaccel --budget 4GiB
cd $R && patch -p1 < .device/stack_vectors_only.patch && source benchmarks/device/prep.sh && cd /tmp/pkg
dump trivec --method triaccel --budget 4GiB
for n in amp tri trivec; do python3 -c "
import json; c=json.load(open('/tmp/runs/hd_$n/summary.json'))['compile_log']['total']['critical']
print('$n critical %.2f' % c['seconds'], [t for t in c['top'] if t[0] == 'jit(train_body)'])" >> $O/hlo/table.txt 2>&1; done
python3 benchmarks/hlo_fusions.py $O/hlo/tri-train_body.txt $O/hlo/trivec-train_body.txt --top 25 --show input_transpose_fusion >> $O/hlo/table.txt 2>&1
python3 benchmarks/hlo_fusions.py $O/hlo/amp-train_body.txt $O/hlo/tri-train_body.txt --top 25 --show input_transpose_fusion >> $O/hlo/table.txt 2>&1
python3 benchmarks/hlo_fusions.py $O/hlo/tri-train_body.txt --top 25 --show input_reduce_fusion >> $O/hlo/table.txt 2>&1
cd /tmp/pkg
OUT=$O/fused timeout 150 python3 benchmarks/device/jax_fused_steps_probe.py --k 10 > $O/fused/k10.txt 2>&1
OUT=$O/fused/k25 timeout 90 python3 benchmarks/device/jax_fused_steps_probe.py --k 25 --variants scan > $O/fused/k25.txt 2>&1
cat $O/hlo/table.txt | cut -c1-160; tail -6 $O/fused/k10.txt; tail -3 $O/fused/k25.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
