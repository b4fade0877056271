# (next session, third call, ~5 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 400)
# #15's step ratio (<= 1.03 against AMP at the same batch, eager) with kernels="stock" beside the Triton default:
# benchmarks/torch_overhead.py's interleaved rounds, ResNet-18 at bs 96 and 384 (2026-11-24: tri 1.031-1.038 at
# bs 96, 0.988-1.012 at 384), then EfficientNet-B0 at bs 384.
O=$OUT; mkdir -p $O/to; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 200 python3 benchmarks/torch_overhead.py --batch-sizes 96 384 --rounds 8 --optimizers fused --no-curvature \
  --variants amp tri tri-stock --out $O/to > $O/to/r18.log 2>&1; echo "r18 rc $?"
timeout 150 python3 benchmarks/torch_overhead.py --model efficientnet_b0 --batch-sizes 384 --rounds 6 --optimizers fused \
  --no-curvature --variants amp tri tri-stock --out $O/to/eff > $O/to/eff.log 2>&1; echo "eff rc $?"
grep -E "^ +[0-9]+ +fused" $O/to/r18.log $O/to/eff.log
