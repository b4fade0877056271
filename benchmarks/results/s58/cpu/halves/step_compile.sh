#!/bin/bash
# As run on the dev box (2 cores, jax 0.10.2 CPU), 2026-12-08 ~03:40Z: the JAX demo's fused step (train_body) compiled
# cold with the halves before ("old": 731268f's transform.py and grad_moments.py, by reversing
# benchmarks/results/s58/next/halves_stacked.patch) and now ("new"), alternated; s55's jax_demo_step_compile_cpu.sh
# options (ResNet-18 / EfficientNet-B0 width 1, bs 96 padded to 512, compile cache and compile-ahead off).
cd "$(git rev-parse --show-toplevel)"
P=benchmarks/results/s58/next/halves_stacked.patch
one() { name=$1; shift; timeout 900 .venv/bin/python -m examples.cifar.train --backend jax --batch 96 --width 1 --train-subset 192 \
  --test-subset 100 --epochs 1 --no-progress --pad-floor 512 --compile-cache off --compile-ahead off --data ../shared/data/cifar10-jpeg \
  --method triaccel --budget 4GiB --out /tmp/cc58/$name "$@" > /tmp/cc58/$name.log 2>&1
  echo "$name $(grep -o 'jit(train_body) [0-9.]*s' /tmp/cc58/$name.log | head -1)" | tee -a /tmp/cc58/table.txt; }
for m in ${MODELS:-resnet18}; do
  for i in 1 2; do
    patch -s -R -p1 < $P; one old-$m-$i --model $m; patch -s -p1 < $P
    one new-$m-$i --model $m
  done
done
