#!/bin/bash
# As run on the dev box (2 cores, jax 0.10.2 CPU), 2026-12-08 ~02:38Z, one run at a time: --fused-step off as at
# 4c6b0a9 (old_off: the halves as two gradient calls the host measures), --fused-step off with
# noise_in_update_two_programs.patch applied to examples/ (new_off: each call as the gradient then the update
# program, the halves measured in the update), and the fused step (new_on; the patch leaves it as it was).
# /tmp/s58old was `git worktree add /tmp/s58old 4c6b0a9`; /work/main had the patch applied.
cd /work/main
run() { # tree mode out
  ( cd $1 && PYTHONPATH=$1 /work/main/.venv/bin/python -m examples.cifar.train --backend jax --method triaccel --budget 4GiB \
    --data /work/shared/data/cifar10-jpeg --train-subset 6400 --test-subset 500 --width 0.25 --epochs 2 --device cpu \
    --no-progress --compile-cache off --out /tmp/s58cpu/ab/$3 --fused-step $2 > /tmp/s58cpu/ab/$3.log 2>&1 )
}
mkdir -p /tmp/s58cpu/ab
run /tmp/s58old off old_off
run /work/main off new_off
run /work/main on new_on
