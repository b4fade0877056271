# (s48 call 4, ~6 min, nvidia-h200, carry [".device"]; timeout_s 400)
# torch EfficientNet-B0, graphed, cold, seeds 0-1: where the steady bs-512 epochs' ~2.5% over AMP bs 512 L goes.
# The default (t_ctrl 50: a control boundary, one blocking read of the statistics ring, and a noise step every
# 50 steps) beside noise steps every 100 (t_noise=100, boundaries every 50) and boundaries + noise every 100
# (--t-ctrl 100). Compare epochs 3-10 (all at 512) from the step records.
O=$OUT; mkdir -p $O/eff; date -u
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="0 1" LIMIT=50 timeout 330 bash benchmarks/device/torch_variants.sh \
  "amp512gL=--method amp --batch 512 --compile graphs --set short_step_lr=linear" \
  "trig=--method triaccel --budget 4GiB --compile graphs" \
  "trigtn100=--method triaccel --budget 4GiB --compile graphs --set t_noise=100" \
  "trigtc100=--method triaccel --budget 4GiB --compile graphs --t-ctrl 100" \
  > $O/eff/torch.log 2>&1
echo "== eff"; grep -v "^W1\|Warning" $O/eff/torch.log | grep "acc\|wall_s\|rror" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//" | head -20
mkdir -p $O/sr && tar xzf $O/eff/step-records.tgz -C $O/sr && python3 - $O/sr <<'PY'
import json, sys, glob, os
for f in sorted(glob.glob(sys.argv[1] + "/*/*.jsonl")):
    steps = [r for r in map(json.loads, open(f)) if r.get("type") == "step"]
    ep = {}
    for r in steps: ep[r["epoch"]] = r["host_s"]
    print(f.split("/")[-2], os.path.basename(f)[:-6].ljust(10), "epochs", [round(ep[e], 2) for e in sorted(ep)],
          "3-10 sum", round(sum(ep[e] for e in sorted(ep)[2:]), 3))
PY
rm -rf $O/sr; cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
