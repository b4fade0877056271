# (~6.5 min, nvidia-h200, carry [".device"]; timeout_s 560)
# #14/#15 JAX ResNet-18: which part of the wrapper makes its step compile 1.33-1.42x AMP's (s50 call 4: 12.85 against
# 9.68 s; call 2: 26.3 against 18.5 s)? One cold epoch on 2,048 images per variant (own empty caches), the step's
# `jit(train_body)` compile seconds from the log: AMP bs 192; AMP padded to 512 with the masked BatchNorm; triaccel;
# triaccel without the masked BatchNorm; triaccel without the batch lever (no noise halves, no pad floor);
# triaccel without the precision lever; AMP and triaccel again at the end (the machine's drift).
O=$OUT; mkdir -p $O/logs; date -u
source benchmarks/device/prep.sh; cd /tmp/pkg
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 80 python3 -m examples.cifar.train --backend jax \
  --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 --test-subset 1000 \
  --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/logs/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/logs/$name.log) | $(grep -m1 'train compiles' $O/logs/$name.log)" >> $O/table.txt; }
one amp192 --method amp --batch 192
one amp512mask --method amp --batch 192 --pad-floor 512 --bn-mask on
one tri --method triaccel --budget 4GiB
one tri_nomask --method triaccel --budget 4GiB --bn-mask off
one tri_prec --method triaccel --budget 4GiB --levers precision
one tri_batch --method triaccel --budget 4GiB --levers batch
one amp192b --method amp --batch 192
one trib --method triaccel --budget 4GiB
cut -c1-220 $O/table.txt
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
