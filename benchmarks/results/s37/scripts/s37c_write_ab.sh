# (~7 min) #15: the JAX boundary with only changed fields written and no put-back when nothing changed (this commit)
# against 64c8925 (keys hashed once only), profiled, same machine; 3 interleaved rounds of AMP against triaccel-fixed
# at bs 96 with the new code. #14: torch ResNet-18 seed 1, AMP bs 192 against triaccel, both --compile graphs, with
# the summary's new setup / evaluation / plot seconds.
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
rm -rf /tmp/pkg_old && cp -r /tmp/pkg /tmp/pkg_old && cp $R/.device/split_step_64c8925.py /tmp/pkg_old/triaccel/backends/jax/split_step.py \
  && cp $R/.device/transform_64c8925.py /tmp/pkg_old/triaccel/backends/jax/transform.py
O=$OUT; D=/tmp/data/cifar10-jpeg
args="--backend jax --model resnet18 --data $D --seed 0 --no-progress --epochs 2 --batch 96 --method triaccel --levers precision --batch-max 96 --compile-cache /tmp/cc/bp"
for v in warm new old new2 old2; do
  p=/tmp/pkg; case $v in old*) p=/tmp/pkg_old;; esac
  (cd $p && PYTHONPATH=/tmp/site:$p timeout 150 python3 benchmarks/device/jax_boundary_profile.py --from-step 200 --top 30 -- $args --out /tmp/runs/bp-$v > $O/bp-$v.log 2>&1); echo "bp-$v rc $?"
  grep "^boundary\|^epoch" $O/bp-$v.log
done
mkdir -p $O/ab $O/r18
OUT=$O/ab MODEL=resnet18 BATCH=96 ROUNDS=3 EPOCHS=3 LIMIT=150 bash $R/benchmarks/device/jax_step_ab.sh > $O/ab.log 2>&1
grep -v "^  epoch 1\|ms  MemcpyH2D\|ThenExecute" $O/ab.log | grep "acc\|epoch [23]\|control" | tail -n 30
OUT=$O/r18 MODEL=resnet18 SEEDS=1 LIMIT=80 bash benchmarks/device/torch_variants.sh \
  "amp192g=--method amp --batch 192 --compile graphs" "trig2=--method triaccel --budget 4GiB --compile graphs" > $O/r18/torch.log 2>&1
grep -v "^W1\|Warning" $O/r18/torch.log | grep "acc\|graphs\|wall_s\|rror" | head -20
grep -h "plots (" $O/r18/s1/*.log
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
