# (next session, ~4 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 300)
# #14 torch EfficientNet-B0, graphed, seed 0: triaccel's bs-512 epochs take 1.80 s against AMP bs 512 L's 1.76
# (s48 calls 1 and 4), and halving the control boundaries or the noise steps did not shorten them (s48 call 4).
# s43's trace of 40 steps inside an epoch found the same GPU work per step: so trace across an epoch's end.
# Epoch starts (s48 call 1, seed 0): AMP 490, 588; triaccel 796, 892 (a boundary and a noise step at 800).
O=$OUT; mkdir -p $O/tr; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
run() { name=$1; shift; timeout 120 python3 -m examples.cifar.train --backend torch --model efficientnet_b0 --data $D \
  --seed 0 --no-progress --compile graphs --out /tmp/runs/$name "$@" > $O/tr/$name.log 2>&1; echo "$name rc $?"
  python3 benchmarks/trace_summary.py /tmp/runs/$name --counts --gaps 12 --json $O/tr/$name-summary.json > $O/tr/$name-trace.txt 2>&1
  head -40 $O/tr/$name-trace.txt; }
run amp512 --method amp --batch 512 --set short_step_lr=linear --epochs 6 --trace-steps 474:506
run tri --method triaccel --budget 4GiB --epochs 6 --trace-steps 780:812
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
