# (next session, FIRST call, ~6 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 400)
# torch: a noise step's host read no longer waits for the GPU (fed at the next statistics flush; committed
# CPU-tested only, in the default path: this call is also its first GPU run). On 2026-11-28 (s43 call 2) 40
# steady bs-512 EfficientNet-B0 steps with one boundary and one noise step kept the GPU busy 93% (17.97 ms of
# 19.34 ms per step) against AMP's 97% (18.06 of 18.58 ms); steady epochs 1.81-1.82 s against 1.76-1.77 s.
# 1) the same traces (AMP bs 512 epoch 4's steps 300-339, triaccel epoch 5's 740-779) with --gaps: the device's
# idle intervals by step and by the host event that ran then; 2) EfficientNet-B0 seeds 0-1 beside AMP bs 512 L:
# compare the steady epochs with s43 call 3's (default: 1.81-1.82 s) and the accuracy (deterministic per seed:
# 75.14 / 76.20% before; the same decisions are expected, so the same accuracy).
O=$OUT; mkdir -p $O/tr $O/eff; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
D=/tmp/data/cifar10-jpeg
run() { name=$1; shift; timeout 120 python3 -m examples.cifar.train --backend torch --model efficientnet_b0 --data $D \
  --seed 0 --no-progress --compile graphs --out /tmp/runs/$name "$@" > $O/tr/$name.log 2>&1; echo "$name rc $?"
  python3 benchmarks/trace_summary.py /tmp/runs/$name --counts --gaps 10 --json $O/tr/$name-summary.json \
    > $O/tr/$name-trace.txt 2>&1
  head -4 $O/tr/$name-trace.txt; grep -A12 "device idle" $O/tr/$name-trace.txt; }
run amp512 --method amp --batch 512 --epochs 4 --trace-steps 300:340
run tri --method triaccel --budget 4GiB --epochs 5 --trace-steps 740:780
cd $R
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=60 timeout 190 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed 's/setup_phases.*//' | head -12
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
