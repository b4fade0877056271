# (~8.5 min; LIGHT=1: ~6 min, without the default's run (s54 seed 0 (2026-12-07 ~17:05Z): 1.027-1.032x AMP's wall); nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# s56's next70 (JAX EfficientNet-B0 seed 1, 10 epochs cold: AMP bs 512, the default, --fused-step off), after a
# ~40 s probe of where the wrapped update's 45 Triton fusions come from (s56 call 2: EfficientNet-B0's wrapped update
# compiles 6.45 s against plain SGD's 1.52 s): jax 0.11's XLA flags naming triton / fusion, and the optimized
# update's Triton fusion computations (their op mix) from an HLO dump of `jax_update_compile.py --variants auto`.
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
source benchmarks/results/s57/next/probe_update_fusions.sh; cd $R   # the probe (its header)
V=("amp512=--method amp --batch 512"); [ -z "$LIGHT" ] && V+=("tri=--method triaccel --budget 4GiB")
V+=("unfused=--method triaccel --budget 4GiB --fused-step off")
OUT=$O MODEL=efficientnet_b0 SEEDS="1" LIMIT=180 timeout 500 bash benchmarks/device/jax_variants.sh "${V[@]}" > $O/jax.log 2>&1
grep -v "^W1\|Warning" $O/jax.log | grep "acc\|wall_s\|rror\|train compiles" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
