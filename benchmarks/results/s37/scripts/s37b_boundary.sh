# (~6 min) #15: the JAX control boundary's host time at bs 96 (ResNet-18, triaccel-fixed: --levers precision), with the
# variant keys hashed once (this commit) and without (split_step.py of c6d1bfa), profiled; then 3 interleaved rounds of
# AMP against triaccel-fixed at bs 96 (3 epochs each) with the new code.
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
rm -rf /tmp/pkg_old && cp -r /tmp/pkg /tmp/pkg_old && cp $R/.device/split_step_c6d1bfa.py /tmp/pkg_old/triaccel/backends/jax/split_step.py
O=$OUT; D=/tmp/data/cifar10-jpeg
args="--backend jax --model resnet18 --data $D --seed 0 --no-progress --epochs 2 --batch 96 --method triaccel --levers precision --batch-max 96 --compile-cache /tmp/cc/bp"
for v in new old new2; do
  p=/tmp/pkg; [ $v = old ] && p=/tmp/pkg_old
  (cd $p && PYTHONPATH=/tmp/site:$p timeout 150 python3 benchmarks/device/jax_boundary_profile.py --from-step 200 --top 40 -- $args --out /tmp/runs/bp-$v > $O/bp-$v.log 2>&1); echo "bp-$v rc $?"
  grep "^boundary\|^epoch" $O/bp-$v.log
done
mkdir -p $O/ab
OUT=$O/ab MODEL=resnet18 BATCH=96 ROUNDS=3 EPOCHS=3 LIMIT=150 bash $R/benchmarks/device/jax_step_ab.sh > $O/ab.log 2>&1
grep -v "^  epoch 1\|ms  MemcpyH2D\|ThenExecute" $O/ab.log | tail -n 45
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
