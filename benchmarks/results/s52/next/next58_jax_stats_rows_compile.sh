# (next session: ~7 min, nvidia-h200, carry [".device"]; copy it and next/row1024.patch to .device/; timeout_s 540)
# #14/#15 JAX: the statistics' large arrays reduced in rows of 1024 and all their rows together
# (moments_reference_jnp_tree(row=1024), built in s52, off by default: ROW = 0), against XLA's own two-stage split
# (4 kernels per large array in s51's dump). One cold epoch on 2,048 images each: ResNet-18 with the step's
# optimized HLO dumped (fusion counts), then EfficientNet-B0's compile; HEAD first, then with the patch. Before each,
# the wrapped update alone (benchmarks/jax_update_compile.py: compile s, fusions, Triton fusions, ms per call).
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
one() { name=$1; model=$2; shift 2; rm -rf /tmp/hc /tmp/hd; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc "$@" timeout 160 python3 -m examples.cifar.train \
  --backend jax --model $model --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 --test-subset 500 \
  --compile-cache /tmp/hc/jax --out /tmp/runs/$name --method triaccel --budget 4GiB > $O/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/$name.log)" >> $O/table.txt
  f=$(ls /tmp/hd/*train_body*after_optimizations.txt 2>/dev/null | grep -v buffer | head -1); [ -n "$f" ] && gzip -c $f > $O/$name-train_body.txt.gz; }
upd() { for m in resnet18 efficientnet_b0; do timeout 100 python3 benchmarks/jax_update_compile.py --model $m --width 1 \
  --variants plain auto --out $O/upd-$1 2>&1 | tail -4; done > $O/update-$1.txt; cat $O/update-$1.txt; }
upd row0
one r18_row0 resnet18 env XLA_FLAGS="--xla_dump_to=/tmp/hd --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_body.*"
one eff_row0 efficientnet_b0 env
cd $R && patch -p1 < .device/row1024.patch && source benchmarks/device/prep.sh && cd /tmp/pkg
upd row1024
one r18_row1024 resnet18 env XLA_FLAGS="--xla_dump_to=/tmp/hd --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_body.*"
one eff_row1024 efficientnet_b0 env
for v in row0 row1024; do zcat $O/r18_$v-train_body.txt.gz > /tmp/r18_$v.txt; done
python3 benchmarks/hlo_fusions.py /tmp/r18_row0.txt /tmp/r18_row1024.txt > $O/fusions.txt 2>&1; tail -25 $O/fusions.txt
cat $O/table.txt
