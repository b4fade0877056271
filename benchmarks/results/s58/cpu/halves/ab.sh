#!/bin/bash
# As run on the dev box (2 cores, jax 0.10.2 CPU), 2026-12-08 ~03:03Z-03:07Z, from the repository root with the
# change (the noise halves from the moments' stacking, backends/jax/transform.py + kernels/grad_moments.py)
# uncommitted: "old" runs with it stashed (the code of 731268f), "new" with it; one process per variant.
for i in 1 2; do
  git stash -q
  PYTHONPATH=$PWD python benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --calls 50 --variants auto --noise --out /tmp/s58cpu/upd/abo$i
  git stash pop -q
  PYTHONPATH=$PWD python benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --calls 50 --variants auto --noise --out /tmp/s58cpu/upd/abn$i
done
git stash -q
PYTHONPATH=$PWD python benchmarks/jax_update_compile.py --model resnet18 --width 1 --calls 30 --variants auto --noise --out /tmp/s58cpu/upd/r18old
git stash pop -q
PYTHONPATH=$PWD python benchmarks/jax_update_compile.py --model resnet18 --width 1 --calls 30 --variants auto --noise --out /tmp/s58cpu/upd/r18new
PYTHONPATH=$PWD python benchmarks/jax_update_compile.py --model resnet18 --width 1 --calls 30 --variants plain auto --out /tmp/s58cpu/upd/r18base
# each run's JSON copied here as <out folder name>.json
