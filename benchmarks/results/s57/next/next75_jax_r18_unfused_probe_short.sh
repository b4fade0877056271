# (~4.5 min; SEEDS=6 T=110: ~3 min, nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# for ~4.5 min of device time: the probe, then ResNet-18 seeds 6-7, AMP bs 192 / --fused-step off, 10 epochs cold (s56
# call 1 had the default at 1.187 / 1.124x AMP bs 192's wall on these seeds). Ratios within this call.
# next72's header: nvidia-h100-x1 or nvidia-h200, carry [".device"]; copy it to .device/; timeout_s 590)
# s56's next70 (JAX EfficientNet-B0 seed 1, 10 epochs cold: AMP bs 512, the default, --fused-step off), after a
# ~40 s probe of where the wrapped update's 45 Triton fusions come from (s56 call 2: EfficientNet-B0's wrapped update
# compiles 6.45 s against plain SGD's 1.52 s): jax 0.11's XLA flags naming triton / fusion, and the optimized
# update's Triton fusion computations (their op mix) from an HLO dump of `jax_update_compile.py --variants auto`.
O=$OUT; mkdir -p $O; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
source benchmarks/results/s57/next/probe_update_fusions.sh; cd $R   # the probe (its header)
(cd $O && tar czf probe.tgz --remove-files xla_flags*.txt triton_fusions.txt hlo_fusions.txt upd* 2>/dev/null)   # each part packed as it ends: a cut call still returns few files
mkdir -p $O/r18
show() { echo "== $1"; grep -v "^W1\|Warning" $O/$1/jax.log | grep "acc\|wall_s\|rror\|train compiles" | sed "s/'loader'.*'flops'/'flops'/;s/process_s.*steps/steps/;s/peak.*//;s/setup_phases.*//"; }
OUT=$O/r18 MODEL=resnet18 SEEDS="${SEEDS:-6 7}" LIMIT=80 timeout ${T:-220} bash benchmarks/device/jax_variants.sh \
  "amp192=--method amp --batch 192" "unfused=--method triaccel --budget 4GiB --fused-step off" > $O/r18/jax.log 2>&1
show r18; (cd $O && tar czf r18.tgz --remove-files r18); ls $O
