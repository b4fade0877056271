# #14 torch ResNet-18 graphed: (1) where the set-up's model->arrays stretch (3.7-7.3 s, every method) goes: the
# demo under cProfile for one epoch, AMP and triaccel; (2) where a graphed bs-96 step's ~3.5-4 ms goes (GPU time
# ~1.5 ms by the bs-512 rate): traces of steps 150-190 (triaccel at bs 96, one boundary inside), AMP bs 96 and
# AMP bs 192 graphed over the same steps, trace_summary with gaps.
O=$OUT; mkdir -p $O/p $O/tr; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
timeout 60 python3 -m examples.cifar.train --backend torch --model resnet18 --data $D --epochs 1 --train-subset 512 --test-subset 500 --no-progress --out /tmp/runs/warm --method amp > $O/p/warm.log 2>&1; echo "warm rc $?"
prof() { name=$1; shift; timeout 90 python3 -m cProfile -o $O/p/$name.prof -m examples.cifar.train --backend torch --model resnet18 --data $D \
  --seed 0 --epochs 1 --no-progress --compile graphs --out /tmp/runs/$name "$@" > $O/p/$name.log 2>&1; echo "$name rc $?"
  python3 -c "import json; d=json.load(open('/tmp/runs/$name/summary.json')); print({k: d.get(k) for k in ('wall_s','setup_s','setup_phases','train_s')})"
  python3 -c "
import pstats,sys; s=pstats.Stats('$O/p/$name.prof'); s.sort_stats('cumulative')
s.print_stats(45)" > $O/p/$name-cum.txt 2>&1
  python3 -c "
import pstats; s=pstats.Stats('$O/p/$name.prof'); s.sort_stats('tottime'); s.print_stats(25)" > $O/p/$name-tot.txt 2>&1; }
prof pamp --method amp --batch 192
prof ptri --method triaccel --budget 4GiB
tr() { name=$1; shift; timeout 90 python3 -m examples.cifar.train --backend torch --model resnet18 --data $D \
  --seed 0 --epochs 1 --no-progress --compile graphs --out /tmp/runs/$name "$@" > $O/tr/$name.log 2>&1; echo "$name rc $?"
  python3 benchmarks/trace_summary.py /tmp/runs/$name --gaps 12 --json $O/tr/$name-summary.json > $O/tr/$name-trace.txt 2>&1; }
tr tri96 --method triaccel --budget 4GiB --trace-steps 150:190
tr amp96 --method amp --batch 96 --trace-steps 150:190
tr amp192 --method amp --batch 192 --trace-steps 150:190
for n in tri96 amp96 amp192; do echo "== $n"; head -24 $O/tr/$n-trace.txt; done
for n in pamp ptri; do echo "== $n cum"; grep -E "^ +[0-9]" $O/p/$n-cum.txt | awk '$4>0.3' | head -40; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
