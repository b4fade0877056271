# (next session, ~4 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 300)
# #14 EfficientNet-B0, torch, graphed, seed 0: where triaccel's steady bs-512 epochs lose ~3% against AMP bs
# 512's (1.81-1.82 s against 1.76-1.77 s per epoch, s42 calls 1 and 4). Both traced over 40 steady steps at
# bs 512 (AMP: epoch 4's steps 300-339; triaccel: epoch 5's 740-779, a control boundary and a noise step
# inside, from s42 call 1's step records: epoch 5 = steps 720-818), then benchmarks/trace_summary.py: the GPU's
# busy share and kernels per step. A busy share below AMP's means the device waits for the host (a sync).
O=$OUT; mkdir -p $O/tr; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
run() { name=$1; shift; timeout 120 python3 -m examples.cifar.train --backend torch --model efficientnet_b0 --data $D \
  --seed 0 --no-progress --compile graphs --out /tmp/runs/$name "$@" > $O/tr/$name.log 2>&1; echo "$name rc $?"
  python3 benchmarks/trace_summary.py /tmp/runs/$name --counts --json $O/tr/$name-summary.json > $O/tr/$name-trace.txt 2>&1
  head -30 $O/tr/$name-trace.txt; }
run amp512 --method amp --batch 512 --epochs 4 --trace-steps 300:340
run tri --method triaccel --budget 4GiB --epochs 5 --trace-steps 740:780
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
