# (next session, first: ~9 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #14/#15 JAX ResNet-18: `noise_split="steps"` (59c80da) measures the noise from a half-batch step and the full step
# after it, with no halves in the update (s51 call 3: without the batch lever's halves the wrapped step compiled
# as AMP's, 23.4 s against 20.6-25.3 s; with them 26.7-29.4 s). First the compile alone (one cold epoch on 2,048
# images, `jit(train_body)` s, each variant once), then 10 epochs cold, seeds 1-2: AMP bs 192, triaccel, triaccel
# with the steps split, and with it and `t_noise_warm=10` (call 4's lead; on a CPU the steps estimate was 1.6-8x
# jumpier than the halves' and on one seed of three mostly missing, benchmarks/results/s51/cpu/).
O=$OUT; mkdir -p $O/compile $O/runs; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
one() { name=$1; shift; rm -rf /tmp/hc; mkdir -p /tmp/hc; TRIACCEL_CACHE=/tmp/hc timeout 70 python3 -m examples.cifar.train --backend jax \
  --model resnet18 --epochs 1 --data /tmp/data/cifar10-jpeg --seed 0 --no-progress --train-subset 2048 --test-subset 1000 \
  --compile-cache /tmp/hc/jax --out /tmp/runs/$name "$@" > $O/compile/$name.log 2>&1; echo "$name rc $?"
  echo "$name $(grep -m1 -o 'jit(train_body) [0-9.]*s' $O/compile/$name.log)" >> $O/compile/table.txt; }
one tri --method triaccel --budget 4GiB; one steps --method triaccel --budget 4GiB --set noise_split=steps
cd $R
OUT=$O/runs MODEL=resnet18 SEEDS="1 2" LIMIT=80 timeout 470 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "tri=--method triaccel --budget 4GiB" \
  "steps=--method triaccel --budget 4GiB --set noise_split=steps" \
  "steps_w10=--method triaccel --budget 4GiB --set noise_split=steps --set t_noise_warm=10" > $O/runs/jax.log 2>&1
cat $O/compile/table.txt
grep -v "^W1\|Warning" $O/runs/jax.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
