# (~4 min, nvidia-h200, carry [".device"]; timeout_s 400)
# #14/#15 JAX: where the GPU compilation time goes, by XLA's own timers (benchmarks/xla_compile_phases.py):
# 1. the EfficientNet-B0 update alone, plain and wrapped with the noise halves (s49 call 1: 1.38 s against 14.04 s);
# 2. the ResNet-18 demo, cold (own empty caches), one epoch of 2,048 images: AMP bs 192 and triaccel.
O=$OUT; mkdir -p $O/ph; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
for v in plain auto; do
  timeout 90 python3 benchmarks/xla_compile_phases.py --name eff-$v --top 30 --out $O/ph -- \
    python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise --calls 5 --_one $v > $O/ph/$v.txt 2>&1
  echo "rc $?" >> $O/ph/$v.txt
done
demo() { name=$1; shift; mkdir -p /tmp/ph_$name; TRIACCEL_CACHE=/tmp/ph_$name timeout 120 python3 benchmarks/xla_compile_phases.py \
  --name r18-$name --top 40 --out $O/ph -- python3 -m examples.cifar.train --backend jax --model resnet18 --epochs 1 --data $D \
  --seed 0 --no-progress --train-subset 2048 --test-subset 1000 --compile-cache /tmp/ph_$name/jax --out /tmp/runs/ph_$name "$@" \
  > $O/ph/$name.txt 2>&1; echo "rc $?" >> $O/ph/$name.txt; cp /tmp/runs/ph_$name/summary.json $O/ph/$name-summary.json 2>/dev/null; }
demo amp --method amp --batch 192
demo tri --method triaccel --budget 4GiB
for v in plain auto amp tri; do echo "== phases $v"; grep -v "^wrote" $O/ph/$v.txt | head -26 | cut -c1-140; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
