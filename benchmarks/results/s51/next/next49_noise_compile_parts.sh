# (next session, ~8 min, nvidia-h200, carry [".device"]; copy it and the three next/noise_*.patch to .device/; timeout_s 560)
# #14/#15 JAX ResNet-18: s51 call 3 put most of the triaccel step's extra compilation in the batch lever's noise halves
# (`--levers precision`, no halves: jit(train_body) 23.4 s, AMP 20.6-25.3, triaccel 27.6-29.4). Which part of
# `_noise_halves` (backends/jax/transform.py): the second statistics pass over the combined gradient, the combine
# itself (a select per array feeding the update), or the held accumulator? Diagnostic patches (wrong measurements,
# compile cost only), one cold epoch on 2,048 images each, every variant twice, interleaved, `jit(train_body)` seconds.
O=$OUT; mkdir -p $O/logs; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 80 python3 -m examples.cifar.train --backend jax \
  --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 --test-subset 1000 \
  --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/logs/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/logs/$name.log)" >> $O/table.txt; }
ON=   # the patch applied now (none at first); each one is taken off before the next goes on
with() { cd $R; [ -z "$ON" ] || patch -s -R -p1 < .device/$ON.patch; ON=$1; [ -z "$ON" ] || patch -s -p1 < .device/$ON.patch
  source benchmarks/device/prep.sh; cd /tmp/pkg; }
for rep in a b; do
  with ""; one tri_$rep --method triaccel --budget 4GiB; one tri_prec_$rep --method triaccel --budget 4GiB --levers precision
  for p in noise_no_second_pass noise_no_combine noise_no_acc; do with $p; one ${p}_$rep --method triaccel --budget 4GiB; done
done
with ""; cat $O/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
