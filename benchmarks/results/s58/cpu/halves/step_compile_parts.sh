#!/bin/bash
# As run on the dev box (2 cores, jax 0.10.2 CPU), 2026-12-08 ~04:00Z, after step_compile.sh: the fused step's cold
# compilation with the code of HEAD for AMP, triaccel with the precision lever only (no noise halves in the update)
# and the default triaccel (the halves), s55's options (width 1, bs 96 padded to 512, cache and compile-ahead off).
cd "$(git rev-parse --show-toplevel)"
one() { name=$1; shift; timeout 900 .venv/bin/python -m examples.cifar.train --backend jax --batch 96 --width 1 --train-subset 192 \
  --test-subset 100 --epochs 1 --no-progress --pad-floor 512 --compile-cache off --compile-ahead off --data ../shared/data/cifar10-jpeg \
  --out /tmp/cc58/$name "$@" > /tmp/cc58/$name.log 2>&1
  echo "$name $(grep -o 'jit(train_body) [0-9.]*s' /tmp/cc58/$name.log | head -1)" | tee -a /tmp/cc58/parts.txt; }
for m in resnet18 efficientnet_b0; do
  one amp-$m --model $m --method amp
  one prec-$m --model $m --method triaccel --budget 4GiB --levers precision
  one tri-$m --model $m --method triaccel --budget 4GiB
done
