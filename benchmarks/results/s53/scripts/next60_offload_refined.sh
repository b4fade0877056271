# (next session: ~4 min, nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 400)
# #17: benchmarks/offload.py under 8 GiB in bf16 with the planner's refinement (s52: modelled plans 2.3-7.6% faster at
# 4.2x B0, 0-0.9% at the largest batch), as s30's call 5 ran it (0.65x at Bp 432), then the bound on its result.
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
timeout 360 python3 benchmarks/offload.py --budget 8GiB --amp bf16 --channels-last --steps 5 --out $O/offload-bf16.json > $O/offload.log 2>&1
echo "offload rc $?"; tail -25 $O/offload.log
python3 benchmarks/offload_bound.py $O/offload-bf16.json --out $O/bound.json
