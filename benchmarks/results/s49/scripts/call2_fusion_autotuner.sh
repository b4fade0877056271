# (~8 min, nvidia-h200, carry [".device"]; copy to .device/ first; timeout_s 590)
# #14/#15 JAX: the wrapped EfficientNet-B0 update alone compiles in 14.0 s against plain SGD's 1.4 s with
# only 49 more fusions (call 1): newer XLA autotunes every reduction and transpose fusion between its native
# and its Triton block-level emitter (xla_gpu_experimental_enable_fusion_autotuner), and the wrapper's
# per-array moments are reductions (the models' BatchNorms too). The update with and without that
# autotuning; then #14's comparison with it off on both sides (the demo's --xla-option applies to every
# method's programs): cold, 10 epochs, seed 0, EfficientNet-B0 (AMP bs 512) and ResNet-18 (AMP bs 192).
O=$OUT; mkdir -p $O/fa $O/eff $O/r18; date -u
R=$PWD; source benchmarks/device/prep.sh; cd /tmp/pkg
FA=xla_gpu_experimental_enable_fusion_autotuner=false
for opt in "" "--xla-option=$FA"; do
  timeout 100 python3 benchmarks/jax_update_compile.py --model efficientnet_b0 --width 1 --noise --variants plain auto \
    --calls 20 --out $O/fa/upd${opt:+-fa} $opt > $O/fa/update_eff${opt:+-fa}.log 2>&1; tail -4 $O/fa/update_eff${opt:+-fa}.log
done
cd $R
OUT=$O/eff MODEL=efficientnet_b0 SEEDS=0 LIMIT=200 timeout 330 bash benchmarks/device/jax_variants.sh \
  "amp512fa=--method amp --batch 512 --xla-option $FA" "trifa=--method triaccel --budget 4GiB --xla-option $FA" \
  > $O/eff/jax.log 2>&1
OUT=$O/r18 MODEL=resnet18 SEEDS=0 LIMIT=80 timeout 150 bash benchmarks/device/jax_variants.sh \
  "amp192fa=--method amp --batch 192 --xla-option $FA" "trifa=--method triaccel --budget 4GiB --xla-option $FA" \
  > $O/r18/jax.log 2>&1
for m in eff r18; do echo "== $m"; grep -v "^W1\|Warning" $O/$m/jax.log | grep "acc\|wall_s\|critical\|rror" | sed "s/setup_phases.*//" | head -12
  for f in $O/$m/s0/*.json; do python3 -c "
import json; s=json.load(open('$f')); c=s['compile_log']['total']
print('$f'.split('/')[-1], 'critical', c['critical']['seconds'], [t for t in c['critical']['top'] if 'body' in t[0]])"; done; done
cd $O && tar czf all.tgz --remove-files -- * 2>/dev/null; ls $O
