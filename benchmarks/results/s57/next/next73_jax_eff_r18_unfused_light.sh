# (~8 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# next72 made to fit a short device budget: the probe, then EfficientNet-B0 seed 1 AMP bs 512 / --fused-step off (no
# default run: s54 seed 0 (2026-12-07 ~17:05Z) had it at 1.027-1.032x AMP's wall), then ResNet-18 seed 6 AMP bs 192 / --fused-step off (s56
# call 1 had the default at 1.187x on seed 6). Each pair's ratio within this call.
# next72's header: nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# s56's next70 (JAX EfficientNet-B0 seed 1, 10 epochs cold: AMP bs 512, the default, --fused-step off), after a
# ~40 s probe of where the wrapped update's 45 Triton fusions come from (s56 call 2: EfficientNet-B0's wrapped update
# compiles 6.45 s against plain SGD's 1.52 s): jax 0.11's XLA flags naming triton / fusion, and the optimized
# update's Triton fusion computations (their op mix) from an HLO dump of `jax_update_compile.py --variants auto`.
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
source benchmarks/results/s57/next/probe_update_fusions.sh; cd $R   # the probe (its header)
(cd $O && tar czf probe.tgz --remove-files xla_flags*.txt triton_fusions.txt hlo_fusions.txt upd* 2>/dev/null)   # each part packed as it ends: a cut call still returns few files
mkdir -p $O/eff $O/r18
show() { echo "== $1"; grep -v "^W1\|Warning" $O/$1/jax.log | grep "acc\|wall_s\|rror\|train compiles" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; }
OUT=$O/eff MODEL=efficientnet_b0 SEEDS="1" LIMIT=180 timeout 340 bash benchmarks/device/jax_variants.sh \
  "amp512=--method amp --batch 512" "unfused=--method triaccel --budget 4GiB --fused-step off" > $O/eff/jax.log 2>&1
show eff; (cd $O && tar czf eff.tgz --remove-files eff)
OUT=$O/r18 MODEL=resnet18 SEEDS="6" LIMIT=80 WARMUP=0 timeout 170 bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "unfused=--method triaccel --budget 4GiB --fused-step off" > $O/r18/jax.log 2>&1
show r18; (cd $O && tar czf r18.tgz --remove-files r18); ls $O
