cd "$(git rev-parse --show-toplevel)"   # as run on the dev box (2 cores), 2026-12-07 ~20:27Z-20:35Z; outputs in /tmp/cc
one() { name=$1; shift; timeout 900 .venv/bin/python -m examples.cifar.train --backend jax --batch 96 --width 1 --train-subset 192 --test-subset 100 --epochs 1 --no-progress --pad-floor 512 --compile-cache off --compile-ahead off --data ../shared/data/cifar10-jpeg --out /tmp/cc/$name "$@" > /tmp/cc/$name.log 2>&1; echo "$name $(grep -o 'jit(train_body) [0-9.]*s' /tmp/cc/$name.log | head -1)" >> /tmp/cc/table.txt; }
one amp --method amp
one tri --method triaccel --budget 4GiB
one prec --method triaccel --budget 4GiB --levers precision
one batch --method triaccel --budget 4GiB --levers batch
one steps --method triaccel --budget 4GiB --set noise_split=steps
one amp2 --method amp
one tri2 --method triaccel --budget 4GiB
