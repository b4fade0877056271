# (next session: ~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# #17: ResNet-152 bf16 under 8 GiB with the cost tables as measured and scaled to a step timed with no hook
# (--calibrate on, built 2026-12-07, off by default), then offload_model_check.py on both results: does the joint
# choice's plan-or-not ratio come near the measured one (s53 call 2: modelled 2.18 against 0.85 measured), and do the
# plans still fit the budget (measured peak, replans)?
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
for c in off on; do
  timeout 270 python3 benchmarks/offload.py --budget 8GiB --amp bf16 --channels-last --steps 5 --calibrate $c \
    --out $O/offload-bf16-cal$c.json > $O/offload-cal$c.log 2>&1; echo "calibrate $c rc $?"; tail -12 $O/offload-cal$c.log
done
python3 benchmarks/offload_model_check.py $O/offload-bf16-caloff.json $O/offload-bf16-calon.json --out $O/check.json
