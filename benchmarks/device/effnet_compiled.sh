# Issue 14's next call (H100, ~8 min): EfficientNet-B0's eager step is host-bound (2026-11-23,
# `benchmarks/step_bound.py --model efficientnet_b0`: 33.0 / 36.9 / 36.6 ms eager against 6.9 / 9.9 /
# 18.6 ms as one CUDA graph at batch 96 / 192 / 512), so the static sweep and triaccel both run under
# torch.compile's CUDA graphs here (every run gets the same `--compile reduce-overhead`: a fair sweep).
# channels_last for all: on 2026-11-23 the demo's contiguous EfficientNet was still compiling its first
# step's backward after 300 s, while `benchmarks/device/compile_probe.py` (channels_last) took 116 s
# (docs/results.md, 22:53Z session). A run's compilation takes minutes, so one call holds two runs:
#   bash benchmarks/device/effnet_compiled.sh "AMP bs 192" "AMP bs 512"   (device tool, carry [".device"])
#   bash benchmarks/device/effnet_compiled.sh triaccel
source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 580 python3 benchmarks/table1.py --models efficientnet_b0 --methods "${@:-AMP bs 192}" \
  --seeds 1 --epochs 10 --budget 4GiB --data /tmp/data/cifar10-jpeg --runs $OUT/runs --out $OUT/effnet-compiled.json \
  -- --compile reduce-overhead --memory-format channels_last > $OUT/effnet-compiled.log 2>&1
tail -12 $OUT/effnet-compiled.log; rm -f $OUT/runs/*/*.png $OUT/runs/*/*/*.png
tar -czf $OUT/runs.tgz -C $OUT runs && rm -rf $OUT/runs   # the device tool returns few files
