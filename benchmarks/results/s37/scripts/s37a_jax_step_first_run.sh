# (~6 min) #15 with the JAX defaults of 2026-11-27/28 (kernels="xla", compile-ahead on): (1) the bs-96 step of
# triaccel-fixed (--levers precision) against AMP, 2 interleaved rounds of 3 epochs, round 2 traced (steps 700-730);
# (2) the cold first-run wall, AMP against triaccel from the defaults, both at the demo's bs 96 (jax_first_run.py).
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
O=$OUT; mkdir -p $O/ab
OUT=$O/ab MODEL=resnet18 BATCH=96 ROUNDS=2 EPOCHS=3 TRACE=700:730 LIMIT=150 bash $R/benchmarks/device/jax_step_ab.sh > $O/ab.log 2>&1
tail -n 30 $O/ab.log
timeout 330 python3 benchmarks/jax_first_run.py --data /tmp/data/cifar10-jpeg --budget 4GiB --out $O/jax-first-run.json > $O/first.log 2>&1
echo "first-run rc $?"; tail -n 25 $O/first.log
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
