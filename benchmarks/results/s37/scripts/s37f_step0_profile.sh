# (~2 min) #14: where torch triaccel's first graphed step goes (ResNet-18, --compile graphs, 1 epoch, cold Triton cache), cProfile.
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 120 python3 -m cProfile -o $OUT/r18.prof -m examples.cifar.train --backend torch --model resnet18 --data /tmp/data/cifar10-jpeg \
  --seed 0 --epochs 1 --no-progress --out /tmp/runs/p --method triaccel --budget 4GiB --compile graphs > $OUT/p.log 2>&1
echo "rc $?"; grep "epoch\|final" $OUT/p.log
python3 - <<'PY' > $OUT/prof.txt
import pstats, io, os
p = pstats.Stats(os.environ["OUT"] + "/r18.prof")
p.sort_stats("cumulative").print_stats(45)
s = io.StringIO(); q = pstats.Stats(os.environ["OUT"] + "/r18.prof", stream=s)
q.sort_stats("cumulative").print_stats("triton|graph|FixedMoments|_launch|make_graphed|compile|pynvml|capture", 40)
print(s.getvalue())
PY
sed -n 1,200p $OUT/prof.txt | grep -v "^$" | cut -c1-170 | head -110
