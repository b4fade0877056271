# (~7 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# The noise halves from the moments' stacking (s58, in the JAX default: the held half in the moments' stacked form, the
# mean's moments from the halves' own plus one dot product per array; the moments' per-leaf rows in one concatenation)
# against the code of 731268f (a second moments pass over the mean, a slice per leaf), on the GPU. On the CPU:
# EfficientNet-B0's wrapped update 880 fusions against 1,872 (780 / 936 without halves), ResNet-18's 397 against 662;
# the fused step compiled in 25.5-26.7 s against 29.2-29.9 s (EfficientNet-B0), 6.3-7.2 against 6.4-7.0 s (ResNet-18). The s54 step records had the fused bs-512 EfficientNet-B0 step at 15.95 ms with the old halves, 13.15 ms
# without halves, AMP 11.50 ms (H100). Here: (1) the update alone, both models, new / old / no halves (fusions, call
# ms, compile s); (2) EfficientNet-B0 seed 0, 3 epochs cold, the default new and old: the bs-512 steps of epochs 2-3
# (benchmarks/device/step_gaps.py). The old code is the new one with halves_stacked.patch reversed.
O=$OUT; mkdir -p $O; date -u
R=$PWD; P=$R/benchmarks/results/s58/next/halves_stacked.patch
source benchmarks/device/prep.sh; cd /tmp/pkg
upd() { for m in efficientnet_b0 resnet18; do timeout 120 python3 benchmarks/jax_update_compile.py --model $m --width 1 \
  --calls 50 --variants auto $2 --out $O/upd-$1-$m 2>&1 | tail -1 | sed "s/^/$1 $m /"; done; }
run() { rm -rf /tmp/runs/$1 /tmp/cc/$1; timeout 230 python3 -m examples.cifar.train --backend jax --model efficientnet_b0 \
  --data /tmp/data/cifar10-jpeg --seed 0 --epochs 3 --no-progress --compile-cache /tmp/cc/$1 --method triaccel --budget 4GiB \
  --out /tmp/runs/$1 > $O/$1.log 2>&1; echo "$1 rc $?"; cp /tmp/runs/$1/log.jsonl $O/$1.jsonl
  grep -m1 "train compiles" $O/$1.log; grep "^epoch\|final" $O/$1.log | cut -c1-120
  python3 benchmarks/device/step_gaps.py $O/$1.jsonl --epochs 3 | grep "bs  512\|boundaries" | tail -4; }
upd base ""; upd new --noise
run new
cd $R && { patch -s -R -p1 < $P || git apply -R $P; } && source benchmarks/device/prep.sh; cd /tmp/pkg
upd old --noise
run old
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
